"""Run every `moetailor` verb on a tiny saved checkpoint of every supported architecture (plus a
DeepSeek-V3 model with grouped routing) and write which ones succeed: the evidence behind the
README's architecture list.

    .venv/bin/python scripts/verbs_by_arch.py --out build/verbs [--arch qwen2_moe,mixtral]

(about 10 minutes per architecture on 2 shared cores; runs over different --arch lists, also in
parallel, add up in OUT/verbs.json and the table covers all of them)

Each cell is one CLI call with tiny settings (it checks that the verb runs end to end and writes
what it says, not quality: the models are random). A failure keeps the last lines of its error.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ARCHES = ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "deepseek_v3-grouped"]


def save_model(arch: str, path: Path) -> None:
    from moetailor.models.tiny import char_tokenizer, tiny_grouped_model, tiny_model

    model = tiny_grouped_model() if arch == "deepseek_v3-grouped" else tiny_model(arch, num_experts=8, top_k=2)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(moetailor: str, model: Path, plan: Path, log: Path) -> None:
    """Start `moetailor serve`, ask for one completion, stop it."""
    port = free_port()
    proc = subprocess.Popen([moetailor, "serve", str(model), "--decode-plan", str(plan), "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                body = json.dumps({"model": str(model), "prompt": "add 1 + 2", "max_tokens": 4}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
                if reply["choices"][0]["text"] is None:
                    raise RuntimeError(f"no text in {reply}")
                return
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None:
                    raise RuntimeError(log.read_text()[-600:])
                time.sleep(1)
        raise RuntimeError("server did not answer in 180 s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


NO_SHARED_EXPERT = ("qwen3_moe", "olmoe", "mixtral")   # distill trains router and norms only there (--no-se2)


def verbs(m: Path, w: Path, arch: str = "") -> list[tuple[str, list[str]]]:
    stats, plan, pruned = w / "stats.safetensors", w / "plan.json", w / "pruned"
    quick_eval = ["--tasks", "addition", "--n", "2", "--seeds", "1", "--max-tokens", "4", "--kl-docs", "1",
                  "--kl-window", "32"]
    return [
        ("info", ["info", str(m)]),
        ("calibrate", ["calibrate", str(m), "--data", "mix", "--tokens", "600", "--batch-tokens", "256",
                       "--seq-len", "64", "--fold", "--out", str(stats)]),
        ("plan", ["plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--out", str(plan)]),
        ("prune", ["prune", str(m), str(plan), "--out", str(pruned)]),
        ("generate", ["generate", str(m), "--decode-plan", str(plan), "--prompt", "add 1 + 2", "--max-tokens", "4"]),
        ("generate --decode-model", ["generate", str(m), "--decode-model", str(pruned), "--prompt", "add 1 + 2",
                                     "--max-tokens", "4"]),
        ("generate fold-decode", ["generate", str(m), "--decode-policy", "fold-decode:4", "--fold-stats", str(stats), "--prompt",
                                  "add 1 + 2", "--max-tokens", "4"]),
        ("serve", []),
        ("eval", ["eval", str(m), "--plan", str(plan), "--configs", "baseline,phase-aware", *quick_eval,
                  "--out", str(w / "eval")]),
        ("eval pruned", ["eval", str(pruned), "--configs", "baseline", *quick_eval, "--out", str(w / "eval-pruned")]),
        ("search-k", ["search-k", str(m), "--mean-k", "1.5", "--tokens", "256", "--window", "32",
                      "--heldout-docs", "0", "--out", str(w / "k.json")]),
        ("distill", ["distill", str(m), str(plan), "--steps", "2", "--batch-size", "1", "--seq-len", "32",
                     *(["--no-se2"] if arch in NO_SHARED_EXPERT else []), "--out", str(w / "distilled")]),
        ("split", ["split", str(m), "--parts", "2", "--data", "text", "--tokens", "256", "--seq-len", "64", "--anneal-steps", "50",
                   "--out", str(w / "split")]),
        ("eval --budgets", ["eval", str(w / "split"), "--budgets", "all", "--original", str(m), *quick_eval,
                            "--out", str(w / "eval-budgets")]),
        ("bench decode", ["bench", "decode", "--model", str(m), "--batches", "1,2", "--keep", "0.5", "--steps", "2",
                          "--no-hf", "--out", str(w / "bench-decode")]),
        ("bench ktiers", ["bench", "ktiers", "--model", str(m), "--mix", "1:0.5,2:0.5", "--requests", "4",
                          "--prompt-len", "8", "--max-tokens", "4", "--repeats", "1", "--out", str(w / "bench-kt")]),
        ("demo", ["demo", "--model", str(m), "--plan", str(plan), "--per-task", "1"]),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="build/verbs")
    ap.add_argument("--arch", default=",".join(ARCHES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    moetailor = str(Path(sys.executable).parent / "moetailor")
    record = out / "verbs.json"  # results of earlier runs (other --arch lists) are kept
    results: dict[str, dict[str, str]] = json.loads(record.read_text()) if record.exists() else {}
    for arch in args.arch.split(","):
        w = out / arch
        subprocess.run(["rm", "-rf", str(w)], check=True)
        w.mkdir(parents=True)
        m = w / "model"
        save_model(arch, m)
        results[arch] = {}
        for name, argv in verbs(m, w, arch):
            t0 = time.time()
            log = w / f"{name.replace(' ', '_').replace('-', '')}.log"
            try:
                if name == "serve":
                    serve_once(moetailor, m, w / "plan.json", log)
                    ok, tail = True, ""
                else:
                    r = subprocess.run([moetailor, *argv], capture_output=True, text=True, timeout=900)
                    log.write_text(r.stdout + r.stderr)
                    ok, tail = r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1][:300]
            except Exception as e:  # a timeout or a server that never answered
                ok, tail = False, str(e)[-300:]
            results[arch][name] = "ok" if ok else f"FAIL: {tail}"
            print(f"{arch:22s} {name:24s} {'ok' if ok else 'FAIL'} {time.time() - t0:5.1f}s {'' if ok else tail}",
                  flush=True)
        latest = json.loads(record.read_text()) if record.exists() else {}   # parallel runs write here too
        record.write_text(json.dumps({**latest, arch: results[arch]}, indent=1))
    results = json.loads(record.read_text())
    results = {a: results[a] for a in ARCHES if a in results}
    names = [n for n, _ in verbs(Path("m"), Path("w"))]
    lines = ["| verb | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for n in names:
        lines.append(f"| `{n}` | " + " | ".join("ok" if results[a].get(n) == "ok" else "**fails**"
                                               for a in results) + " |")
    (out / "verbs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(v == "ok" for r in results.values() for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
