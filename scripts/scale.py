"""Real-size runs of the streamed verbs (docs/scale.md): calibrate -> plan -> prune -> held-out KL on a
full-depth OLMoE-1B-7B-shaped checkpoint, and streamed calibration / pruning of depth-reduced
Qwen3-30B-A3B copies as the layer count doubles.

Each verb runs as its own process under ``/usr/bin/time -v`` (wall time, peak RSS). Checkpoints come
from ``moetailor synth``; the depth-reduced copies are views of one deeper synthetic checkpoint (its
shards linked, config and index cut to the first N layers), so only one is written.

    python scripts/scale.py olmoe --model build/olmoe-1b-7b --tokens 4096 --out build/scale
    python scripts/scale.py depth --model build/qwen3-30b-a3b-12 --layers 3,6,12 --tokens 2048 --out build/scale
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

MOETAILOR = str(Path(sys.executable).parent / "moetailor")


def timed(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` under /usr/bin/time -v; wall seconds and peak RSS (GiB) of that process."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    result = {"cmd": " ".join(cmd), "rc": proc.returncode, "seconds": round(time.time() - t0, 1),
              "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2) if rss else None}
    print(json.dumps(result), flush=True)
    if proc.returncode != 0:
        print(text[-3000:], file=sys.stderr)
        raise SystemExit(f"failed: {result['cmd']}")
    return result


def available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def depth_view(src: Path, layers: int, out: Path) -> Path:
    """A checkpoint of the first ``layers`` decoder layers of ``src`` (shards linked, not copied)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keep = {}
    for name, shard in index["weight_map"].items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or int(m.group(1)) < layers:
            keep[name] = shard
    for shard in set(keep.values()):
        os.symlink((src / shard).resolve(), out / shard)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}, indent=1))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / extra, out / extra)
    return out


def olmoe(args) -> dict:
    out, model = Path(args.out) / "olmoe", Path(args.model)
    out.mkdir(parents=True, exist_ok=True)
    stats, plan, pruned = out / "stats.safetensors", out / "plan.json", Path(args.pruned or out / "pruned")
    res = {"model": str(model), "tokens": args.tokens, "free_gib_at_start": round(available_gib(), 1)}
    res["calibrate"] = timed([MOETAILOR, "calibrate", str(model), "--stream", "on", "--data", "text", "--tokens",
                              str(args.tokens), "--batch-tokens", "4096", "--seq-len", "512", "--out", str(stats)],
                             out / "calibrate.log")
    res["calibrate"]["tokens_per_s"] = round(args.tokens / res["calibrate"]["seconds"], 1)
    res["plan"] = timed([MOETAILOR, "plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--model", str(model),
                         "--out", str(plan)], out / "plan.log")
    shutil.rmtree(pruned, ignore_errors=True)
    res["prune"] = timed([MOETAILOR, "prune", str(model), str(plan), "--out", str(pruned)], out / "prune.log")
    res["bytes_full"] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    res["bytes_pruned"] = sum(f.stat().st_size for f in pruned.glob("*.safetensors"))
    res["kl"] = timed([MOETAILOR, "eval", str(model), "--metric", "kl", "--pruned", str(pruned), "--kl-docs", "1",
                       "--kl-window", str(args.kl_window), "--out", str(out / "kl")], out / "kl.log")
    res["kl"]["result"] = json.loads((out / "kl" / "kl.json").read_text())
    free = available_gib()
    if free >= 16:
        code = ("import torch, time; from transformers import AutoModelForCausalLM as A; t=time.time(); "
                f"m=A.from_pretrained('{pruned}', dtype=torch.bfloat16); "
                "print('experts', m.config.num_experts, 'load s', round(time.time()-t,1)); "
                "print('logits finite', bool(torch.isfinite(m(torch.tensor([[5,6,7,8]])).logits).all()))")
        res["reload_stock"] = timed([sys.executable, "-c", code], out / "reload.log")
        res["reload_stock"]["output"] = (out / "reload.log").read_text().splitlines()[:2]
    else:
        res["reload_stock"] = f"skipped: {free:.1f} GiB available (< 16)"
    return res


def depth(args) -> dict:
    out, src = Path(args.out) / "depth", Path(args.model)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in [int(x) for x in args.layers.split(",")]:
        view = depth_view(src, n, out / f"view-{n}")
        stats, plan, pruned = out / f"stats-{n}.safetensors", out / f"plan-{n}.json", out / f"pruned-{n}"
        row = {"layers": n}
        row["calibrate"] = timed([MOETAILOR, "calibrate", str(view), "--stream", "on", "--data", "text", "--tokens",
                                  str(args.tokens), "--batch-tokens", "2048", "--seq-len", "512", "--out", str(stats)],
                                 out / f"calibrate-{n}.log")
        timed([MOETAILOR, "plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--out", str(plan)],
              out / f"plan-{n}.log")
        shutil.rmtree(pruned, ignore_errors=True)
        row["prune"] = timed([MOETAILOR, "prune", str(view), str(plan), "--out", str(pruned)], out / f"prune-{n}.log")
        row["bytes_read"] = sum((view / s).stat().st_size for s in
                                set(json.loads((view / "model.safetensors.index.json").read_text())["weight_map"].values()))
        row["bytes_written"] = sum(f.stat().st_size for f in pruned.glob("*.safetensors"))
        shutil.rmtree(pruned, ignore_errors=True)
        rows.append(row)
    return {"model": str(src), "tokens": args.tokens, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("olmoe", "depth"))
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", default="3,6,12")
    p.add_argument("--kl-window", type=int, default=128)
    p.add_argument("--pruned", default=None)
    p.add_argument("--out", default="build/scale")
    args = p.parse_args()
    t0 = time.time()
    res = olmoe(args) if args.what == "olmoe" else depth(args)
    res["total_seconds"] = round(time.time() - t0, 1)
    res["load_average_end"] = os.getloadavg()
    path = Path(args.out) / f"{args.what}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
