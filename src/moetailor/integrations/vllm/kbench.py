"""`moetailor bench vllm-k`: a `moetailor split` checkpoint served by vLLM on a mixed-budget trace,
vLLM's FIFO scheduler against the k-aware one (``scheduler.KAwareScheduler``), in one run.

The trace: N requests submitted at once, budgets cycling through ``--budgets`` in arrival order (so
FIFO mixes them in every step), ``--new-tokens`` each, greedy, random prompts. Per N and scheduler
(each in its own process, one after the other, the fastest of ``--repeats`` timed runs after a
warm-up): machine tokens/s = N * new tokens / wall seconds of the whole trace (prefill included);
per-user decode tokens/s = (new tokens - 1) / (last token - first token) of each request, reported
as the median and the 10th percentile (the slowest users). The SLO table gives the best machine
tokens/s among the N whose 10th-percentile user still meets ``--slo``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCHEDULERS = ("fifo", "k-aware")


def register_bench(bsub, common) -> None:
    q = bsub.add_parser("vllm-k", help="vLLM on a split checkpoint, mixed budgets: FIFO vs the k-aware scheduler")
    q.add_argument("--model", default="reference", help="'reference', 'synthetic' or a checkpoint directory to split")
    q.add_argument("--split", default=None, help="an existing `moetailor split` checkpoint (skips the split)")
    q.add_argument("--parts", type=int, default=2, help="sub-experts per expert of the split")
    q.add_argument("--budgets", default=None, help="budgets of the trace, cycled (default: a quarter and all of N*k)")
    q.add_argument("--requests", default="8,16,32", help="trace sizes N (requests submitted at once)")
    q.add_argument("--prompt-tokens", type=int, default=48)
    q.add_argument("--new-tokens", type=int, default=32)
    q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    q.add_argument("--schedule", default="tiers+lanes", help="the k-aware scheduler's mode (lanes, tiers, tiers+lanes)")
    q.add_argument("--repeats", type=int, default=2)
    q.add_argument("--slo", type=float, default=10.0, help="per-user decode tokens/s the slowest 10%% must reach")
    common(q, "build/bench/vllm-k", quick=False)
    q.set_defaults(func=run)


def prepare_split(args) -> Path:
    from ...models.loading import resolve_model_path
    from ...transforms.split import split_checkpoint

    if args.split:
        if not (Path(args.split) / "config.json").exists():
            raise ValueError(f"--split {args.split} is not a checkpoint directory (no config.json); give the "
                             f"directory `moetailor split` wrote, or leave --split out to split --model here")
        return Path(args.split)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"split-{args.parts}"
    if (out / "config.json").exists():
        return out
    if args.model == "synthetic":   # the bandwidth-bound model of `bench vllm`, written under --out
        import torch

        from ...bench.synthetic import synthetic_model
        from ...models.tiny import char_tokenizer

        model_dir = args.out / "synthetic"
        if not (model_dir / "config.json").exists():
            synthetic_model(layers=2).to(getattr(torch, args.dtype)).save_pretrained(model_dir)
            char_tokenizer(1024).save_pretrained(model_dir)
    else:
        model_dir = resolve_model_path(args.model)
    split_checkpoint(model_dir, "tasks", args.parts, out, method="random", gate="proxy", tokens=4096, seq_len=128,
                     progress=False, overwrite=True, command="moetailor " + " ".join(sys.argv[1:]))
    return out


def run(args) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("`moetailor bench vllm-k` needs vLLM in this environment: run `make setup-vllm` and use "
                         ".venv-vllm/bin/moetailor bench vllm-k")
    if args.new_tokens < 2:
        raise ValueError("--new-tokens must be at least 2 (decode rates need tokens after the first)")
    split = prepare_split(args)
    from transformers import AutoConfig

    full = int(AutoConfig.from_pretrained(split, local_files_only=True).num_experts_per_tok)
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [max(1, full // 4), full]
    if any(not 1 <= b <= full for b in budgets):
        raise ValueError(f"--budgets {budgets} must lie in [1, {full}] (the split routes {full} sub-experts per token)")
    results = {}
    for sched in SCHEDULERS:
        cmd = [sys.executable, "-m", "moetailor.integrations.vllm.kbench", sched, str(split), args.requests,
               ",".join(map(str, budgets)), str(args.prompt_tokens), str(args.new_tokens), args.dtype, args.schedule,
               str(args.repeats), str(args.out)]
        print(f"[{sched}] starting", flush=True)
        out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            raise RuntimeError(f"{sched} run failed (exit {out.returncode}): {out.stderr[-2000:]}")
        results[sched] = json.loads(line[-1][len("RESULT "):])
    report = {"split": str(split), "budgets": budgets, "full_budget": full, "schedule": args.schedule,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "dtype": args.dtype,
              "results": results, "command": "moetailor " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print_report(report, args.slo)
    return 0


def print_report(report: dict, slo: float) -> None:
    from ...tables import print_table

    ns = sorted({int(n) for r in report["results"].values() for n in r})
    rows = []
    for n in ns:
        f, k = report["results"]["fifo"][str(n)], report["results"]["k-aware"][str(n)]
        rows.append((n, f"{f['tok_s']:.0f}", f"{f['user_p50']:.1f}", f"{f['user_p10']:.1f}", f"{k['tok_s']:.0f}",
                     f"{k['user_p50']:.1f}", f"{k['user_p10']:.1f}", f"{k['tok_s'] / f['tok_s']:.2f}x"))
    print_table(f"vLLM, split checkpoint, budgets {report['budgets']} of {report['full_budget']} cycled, "
                f"{report['new_tokens']} new tokens, {report['dtype']}, k-aware = {report['schedule']}",
                ["requests", "fifo tok/s", "user p50", "user p10", "k-aware tok/s", "user p50", "user p10",
                 "k-aware / fifo"], rows)
    at = []
    for sched in SCHEDULERS:
        ok = [r["tok_s"] for r in report["results"][sched].values() if r["user_p10"] >= slo]
        at.append((sched, f"{max(ok):.0f}" if ok else "none meets it"))
    print_table(f"best machine tokens/s with the slowest 10% of users at >= {slo:g} tokens/s", ["scheduler", "tok/s"], at)


def worker(sched, split, requests, budgets, prompt_tokens, new_tokens, dtype, schedule, repeats, out) -> dict:
    import random
    import statistics

    from vllm import LLM, SamplingParams

    from .launch import engine_kwargs
    from .scheduler import scheduler_kwargs

    ns = [int(n) for n in requests.split(",")]
    ks = [int(b) for b in budgets.split(",")]
    extra = scheduler_kwargs(schedule) if sched == "k-aware" else {}
    llm = LLM(**engine_kwargs(split, dtype=dtype, kv_cache_mib=1024, max_num_seqs=max(ns),
                              max_model_len=prompt_tokens + new_tokens + 8,
                              max_num_batched_tokens=max(2048, max(ns) * prompt_tokens), enable_prefix_caching=False,
                              disable_log_stats=False, **extra))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(split, local_files_only=True).vocab_size
    rng = random.Random(0)
    results = {}
    for n in ns:
        best = None
        for rep in range(repeats + 1):   # the first run warms up
            prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_tokens)]} for _ in range(n)]
            params = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                     extra_args={"expert_top_k": ks[i % len(ks)]}) for i in range(n)]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            users = sorted((new_tokens - 1) / max(1e-9, o.metrics.last_token_ts - o.metrics.first_token_ts)
                           for o in outs)
            row = {"wall_s": wall, "tok_s": n * new_tokens / wall, "user_p50": statistics.median(users),
                   "user_p10": users[max(0, int(0.1 * len(users)) - 1)] if len(users) >= 10 else users[0]}
            if rep and (best is None or row["wall_s"] < best["wall_s"]):
                best = row
        results[str(n)] = best
    llm.llm_engine.engine_core.shutdown()
    return results


if __name__ == "__main__":
    a = sys.argv[1:]
    res = worker(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), a[6], a[7], int(a[8]), a[9])
    print("RESULT " + json.dumps(res), flush=True)
