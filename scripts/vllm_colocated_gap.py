"""Colocated masked pool against the pruned decode checkpoint, without the pair's connector.

Why: `bench vllm` measured the pair's pruned decode instance 1.7-1.9x faster than the colocated masked
50% pool on the same experts per step; this isolates the two decoders. One process holds two vLLM
engines on the synthetic bf16 model that `bench vllm` wrote: A = the full checkpoint with the masked
50% decode plan, B = the pruned 50% checkpoint (plugin loaded, no plan). Both eager or both compiled
(``--compiled``). Rounds alternate which goes first; decode tokens/s = B*(N-1) / (t(N) - t(1)). With
``--perf SECONDS`` the script also samples each engine's worker with ``perf record`` during one
extra generate and prints the hottest symbols of each, so the two can be compared by where their
time goes.

    .venv-vllm/bin/python scripts/vllm_colocated_gap.py build/bench/vllm-kernel --batch 8 32 [--perf 20]
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def worker_pid(before: set[int]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from moetailor.integrations.vllm.bench import _descendants

    new = _descendants() - before
    workers = [p for p in new if Path(f"/proc/{p}/comm").read_text().startswith("VLLM::Worker")]
    return workers[0] if workers else min(new)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="the --out folder of a `bench vllm --model synthetic` run")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--perf", type=float, default=0.0, help="seconds of `perf record` per engine (0: off)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from moetailor.integrations.vllm.bench import _descendants
    from moetailor.integrations.vllm.launch import engine_kwargs

    common = dict(dtype="bfloat16", kv_cache_mib=256, max_num_seqs=max(args.batch), enforce_eager=not args.compiled,
                  max_model_len=48 + args.new_tokens + 8, max_num_batched_tokens=max(2048, 48 * max(args.batch)),
                  disable_log_stats=True, enable_prefix_caching=False)
    engines, pids = {}, {}
    masked = engine_kwargs(args.out / "synthetic", decode_plan=args.out / "plan.json", **common)
    for name, kwargs in (("masked 50%", masked),
                         ("pruned", engine_kwargs(args.out / "pruned", **common))):
        before = _descendants()
        engines[name] = LLM(**kwargs)
        pids[name] = worker_pid(before)
        print(f"{name}: worker pid {pids[name]}", flush=True)
    rng = random.Random(0)
    for b in args.batch:
        best = {}
        for rnd in range(args.rounds + 1):
            prompts = [{"prompt_token_ids": [rng.randrange(3, 1024) for _ in range(48)]} for _ in range(b)]
            for name in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                llm = engines[name]
                time.sleep(1.5)
                t = []
                for n in (1, args.new_tokens):
                    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                    start = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    t.append(time.perf_counter() - start)
                rate = b * (args.new_tokens - 1) / (t[1] - t[0])
                if rnd:
                    best[name] = max(best.get(name, 0.0), rate)
            if rnd:
                print(f"[B={b}] round {rnd}: " + ", ".join(f"{n} {r:.1f}" for n, r in best.items()), flush=True)
        print(f"[B={b}] pruned / masked 50%: {best['pruned'] / best['masked 50%']:.2f}x", flush=True)
        if args.perf:
            for name, llm in engines.items():
                data = f"/tmp/perf-{name.replace(' ', '-').replace('%', '')}-{b}.data"
                prompts = [{"prompt_token_ids": [rng.randrange(3, 1024) for _ in range(48)]} for _ in range(b)]
                rec = subprocess.Popen(["perf", "record", "-F", "499", "-g", "-o", data, "-p", str(pids[name]),
                                        "--", "sleep", str(args.perf)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                deadline = time.time() + args.perf
                while time.time() < deadline - 1:
                    llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
                                 use_tqdm=False)
                rec.wait()
                report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,symbol",
                                         "--stdio", "-g", "none", "--percent-limit", "2"],
                                        capture_output=True, text=True).stdout
                print(f"--- {name}, B={b}: where the worker's time goes (perf, >= 2%) ---")
                print("\n".join(l for l in report.splitlines() if l.strip() and not l.startswith("#")), flush=True)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
