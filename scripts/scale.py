"""Real-size runs of the streamed verbs (docs/scale.md): calibrate -> plan -> prune -> held-out KL on a
full-depth OLMoE-1B-7B-shaped checkpoint, and streamed calibration / pruning of depth-reduced
Qwen3-30B-A3B copies as the layer count doubles.

Each verb runs as its own process under ``/usr/bin/time -v`` (wall time, peak RSS). Checkpoints come
from ``moetailor synth``; the depth-reduced copies are views of one deeper synthetic checkpoint (its
shards linked, config and index cut to the first N layers), so only one is written.

    python scripts/scale.py olmoe --model build/olmoe-1b-7b --tokens 100000 --out build/scale
    python scripts/scale.py depth --model build/qwen3-30b-a3b-16 --layers 2,4,8,16 --tokens 2048 --out build/scale
    python scripts/scale.py decode --model build/olmoe-1b-7b --pruned build/scale/olmoe/pruned \
        --plan build/scale/olmoe/plan.json --out build/scale

``decode``: engine decode tokens/s at each batch for the full checkpoint, the streamed-pruned one and the
full one serving the plan's pool in decode (full router in prefill), one model in memory at a time (each
in its own process, bf16 as stored: no fp32 copy), each next to its read-bandwidth floor: the bytes a
step reads (distinct routed experts, counted by the engine, + every other weight except the embedding
+ the KV cache) divided by the read bandwidth (measured in each process before its model loads; the table
uses the best of the run). ``decode-one`` also reads the bandwidth right before and after each batch and
reports ``of_adjacent_floor`` against their mean: on a machine whose bandwidth drifts within minutes, that
is the floor the row actually ran beside.
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


def routing_summary(stats_path: Path) -> list[dict]:
    """Per MoE layer: experts chosen at all, the 8 hottest experts' share of all routes, and the share of
    tokens that chose the hottest expert (top-k routing: an expert is chosen at most once per token)."""
    from moetailor.calibration import ExpertStats

    stats = ExpertStats.load(stats_path)
    tokens, k = stats.meta["tokens"], stats.model["top_k"]
    rows = []
    for i, layer in sorted(stats.layers.items()):
        f = layer.frequency.double()                                      # [E] tokens that chose each expert
        rows.append({"layer": i, "used": int((f > 0).sum()), "top8_share": round(float(f.topk(8).values.sum() / f.sum()), 3),
                     "hottest_tokens": round(float(f.max() / tokens), 3), "tokens": tokens, "top_k": k})
    return rows


def olmoe(args) -> dict:
    out, model = Path(args.out) / "olmoe", Path(args.model)
    out.mkdir(parents=True, exist_ok=True)
    stats, plan, pruned = out / "stats.safetensors", out / "plan.json", Path(args.pruned or out / "pruned")
    res = {"model": str(model), "tokens": args.tokens, "free_gib_at_start": round(available_gib(), 1)}
    res["calibrate"] = timed([MOETAILOR, "calibrate", str(model), "--stream", "on", "--data", "text", "--tokens",
                              str(args.tokens), "--batch-tokens", "4096", "--seq-len", "512", "--out", str(stats)],
                             out / "calibrate.log")
    res["calibrate"]["tokens_per_s"] = round(args.tokens / res["calibrate"]["seconds"], 1)
    res["routing"] = routing_summary(stats)
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


DECODE_KINDS = ("full", "pruned", "masked")


def decode(args) -> dict:
    out = Path(args.out) / "decode"
    out.mkdir(parents=True, exist_ok=True)
    if not (args.pruned and args.plan):
        raise SystemExit("decode needs --pruned (the streamed-pruned checkpoint) and --plan (the plan it was pruned with)")
    res = {"model": args.model, "pruned": args.pruned, "plan": args.plan, "batches": args.batches,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "load_average_start": os.getloadavg()}
    for kind in DECODE_KINDS:
        rows = out / f"{kind}.json"
        cmd = [sys.executable, __file__, "decode-one", "--kind", kind, "--model", args.model, "--pruned", args.pruned,
               "--plan", args.plan, "--batches", *map(str, args.batches), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--out", str(rows)]
        res[kind] = timed(cmd, out / f"{kind}.log")
        res[kind].update(json.loads(rows.read_text()))
    res["read_gb_s_best"] = max(res[kind]["read_gb_s"] for kind in DECODE_KINDS)
    print(decode_table(res))
    return res


def decode_table(res: dict) -> str:
    """Markdown: each model and batch against the floor at the best read bandwidth measured in the run
    (each process measures it before loading its model; a transient disturbance lowers one figure)."""
    bw = res["read_gb_s_best"]
    lines = [f"read bandwidth per process (GB/s): " + ", ".join(f"{k} {res[k]['read_gb_s']}" for k in DECODE_KINDS)
             + f"; floor at {bw} GB/s", "",
             "| batch | model | step ms | tok/s | distinct experts/layer | GB read/step | achieved GB/s | floor ms | "
             "floor tok/s | of floor | tok/s vs full |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in res["batches"]:
        full = next(r for r in res["full"]["rows"] if r["batch"] == b)
        for kind in DECODE_KINDS:
            r = next(r for r in res[kind]["rows"] if r["batch"] == b)
            floor_ms = r["gb_per_step"] / bw * 1e3
            lines.append(f"| {b} | {kind} | {r['step_ms']} | {r['tok_s']} | {r['distinct_per_layer']} | {r['gb_per_step']} | "
                         f"{r['gb_per_step'] / r['step_ms'] * 1e3:.1f} | {floor_ms:.1f} | {b / floor_ms * 1e3:.1f} | "
                         f"{floor_ms / r['step_ms']:.0%} | {r['tok_s'] / full['tok_s']:.2f}x |")
    return "\n".join(lines)


def decode_one(args) -> None:
    """One model in this process: load it (bf16, as stored), measure the read bandwidth, decode each batch."""
    import torch

    from engine_vs_hf import heldout_prompts
    from moetailor import kernels
    from moetailor.bench.bandwidth import read_bandwidth
    from moetailor.bench.measure import engine_decode, make_llm
    from moetailor.memory import peak_rss_gib
    from moetailor.models.loading import load_model, load_tokenizer
    from moetailor.plans.plan import Plan

    read_bw = read_bandwidth()                       # before the model: 1 GiB buffer, freed again
    path = args.pruned if args.kind == "pruned" else args.model
    t0 = time.time()
    model = load_model(path, dtype=torch.bfloat16)
    res = {"kind": args.kind, "path": path, "load_s": round(time.time() - t0, 1), "rss_after_load_gib": round(peak_rss_gib(), 2),
           "read_gb_s": round(read_bw / 1e9, 2), "threads": torch.get_num_threads(),
           "weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2),
           "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    print(json.dumps(res), flush=True)
    llm = make_llm(model, max(args.batches), args.prompt_len + args.new_tokens + 4, compile_decode=args.compile_decode,
                   pack_weights=kernels.packed_weights_pay() and not args.row_major)   # as `moetailor serve` holds them
    res["compile_decode"] = args.compile_decode
    res["packed_experts"] = llm.runner.expert_weights[False] is not None and any(
        kernels.is_packed(w[0]) for w in llm.runner.expert_weights[False].values())
    if args.kind == "masked":                        # full router in prefill, the plan's pool in decode
        llm.set_plan(Plan.load(args.plan).phase_aware())
    prompts = heldout_prompts(load_tokenizer(path), max(args.batches), args.prompt_len)
    engine_decode(llm, 1, args.prompt_len, 2, prompt_ids=prompts[:1])                  # warm-up
    if args.compile_decode:                          # and the dynamic-shape graph a batch > 1 compiles
        engine_decode(llm, 2, args.prompt_len, 2, prompt_ids=prompts[:2])
    res["rows"] = []
    for b in args.batches:
        # the yardstick again right before and after this batch: this machine's bandwidth moves by 2x within
        # minutes, so the floor beside each row is the mean of the two reads around it (the start-up one kept)
        before = read_bandwidth()
        r = engine_decode(llm, b, args.prompt_len, args.new_tokens, prompt_ids=prompts[:b])
        adjacent = (before + read_bandwidth()) / 2
        floor_s = r.total_bytes / read_bw
        row = {"batch": b, "step_ms": round(1e3 * r.step_s, 1), "tok_s": round(r.tokens_per_s, 2),
               "steps": r.steps, "distinct_per_layer": round(r.distinct, 1),
               "expert_gb_per_step": round(r.expert_bytes / 1e9, 3), "gb_per_step": round(r.total_bytes / 1e9, 3),
               "floor_ms": round(1e3 * floor_s, 1), "floor_tok_s": round(b / floor_s, 2),
               "of_floor": round(floor_s / r.step_s, 3), "adjacent_read_gb_s": round(adjacent / 1e9, 2),
               "of_adjacent_floor": round(r.total_bytes / adjacent / r.step_s, 3)}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    res["peak_rss_gib"] = round(peak_rss_gib(), 2)
    from moetailor.bench.page import Table, write_tables
    write_tables(args.out, [Table(
        f"{path}: decode steps against the read floor ({res['weights_gib']} GiB {', '.join(res['dtypes'])}, "
        f"experts {'packed' if res['packed_experts'] else 'row-major'}, {res['threads']} threads, "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens)",
        ["batch", "step ms", "tok/s", "GB read/step", "floor ms", "of floor (start-up yardstick)",
         "read GB/s beside the row", "of the adjacent floor"],
        [[r["batch"], r["step_ms"], r["tok_s"], r["gb_per_step"], r["floor_ms"], f"{100 * r['of_floor']:.0f}%",
          r["adjacent_read_gb_s"], f"{100 * r['of_adjacent_floor']:.0f}%"] for r in res["rows"]])], **res)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("olmoe", "depth", "decode", "decode-one"))
    p.add_argument("--model", required=True)
    p.add_argument("--plan", default=None, help="decode: the plan the pruned checkpoint was made with")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--kind", choices=DECODE_KINDS, default="full", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", default="3,6,12")
    p.add_argument("--kl-window", type=int, default=128)
    p.add_argument("--pruned", default=None)
    p.add_argument("--compile-decode", action="store_true", help="decode-one: the engine's decode through torch.compile")
    p.add_argument("--row-major", action="store_true", help="decode-one: keep the experts in the checkpoint's layout "
                   "(the engine packs them for its kernel where that pays)")
    p.add_argument("--out", default="build/scale")
    args = p.parse_args()
    if args.what == "decode-one":
        return decode_one(args)
    t0 = time.time()
    res = {"olmoe": olmoe, "depth": depth, "decode": decode}[args.what](args)
    res["total_seconds"] = round(time.time() - t0, 1)
    res["load_average_end"] = os.getloadavg()
    path = Path(args.out) / f"{args.what}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
