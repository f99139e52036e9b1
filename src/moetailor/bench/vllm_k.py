"""`moetailor bench vllm-k`: a `moetailor split` checkpoint served by vLLM on a mixed-budget trace,
vLLM's FIFO scheduler against the k-aware one (``scheduler.KAwareScheduler``), in one run; docs/vllm.md
describes the trace and the method.

Both engines are alive in one process and timed in turn, the order swapping every round, so that drift
of the machine hits both alike (each in its own process, one after the other, moved FIFO by 19-23%
between runs). Machine tokens/s = N * new tokens / wall seconds of the whole trace; per-user decode
tokens/s = (new tokens - 1) / (last token - first token) of each request, median and 10th percentile.
"""
from __future__ import annotations

import json
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
    q.add_argument("--max-num-seqs", type=int, default=8,
                   help="requests per step; a trace longer than this queues, and admission order (tiers) matters")
    q.add_argument("--experts-kernel", action="store_true",
                   help="both engines on moetailor's experts kernel (skips the routes a budget drops)")
    common(q, "build/bench/vllm-k", quick=False)
    q.set_defaults(func=run)


def prepare_split(args) -> Path:
    from ..transforms.split import split_checkpoint
    from .vllm import model_dir

    if args.split:
        if not (Path(args.split) / "config.json").exists():
            raise ValueError(f"--split {args.split} is not a checkpoint directory (no config.json); give the "
                             f"directory `moetailor split` wrote, or leave --split out to split --model here")
        return Path(args.split)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"split-{args.parts}"
    if (out / "config.json").exists():
        return out
    split_checkpoint(model_dir(args), "tasks", args.parts, out, method="random", gate="proxy", tokens=4096, seq_len=128,
                     progress=False, overwrite=True, command="moetailor " + " ".join(sys.argv[1:]))
    return out


def run(args) -> int:
    from transformers import AutoConfig

    from ..outputs import check_output
    from .vllm import check_vllm_args, run_worker

    check_vllm_args(args, "vllm-k", "decode rates need")
    check_output(args.out, overwrite=True, directory=True, replaces=False)   # one run per --out at a time (it caches there)
    split = prepare_split(args)
    full = int(AutoConfig.from_pretrained(split, local_files_only=True).num_experts_per_tok)
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [max(1, full // 4), full]
    if any(not 1 <= b <= full for b in budgets):
        raise ValueError(f"--budgets {budgets} must lie in [1, {full}] (the split routes {full} sub-experts per token)")
    spec = {"split": str(split), "requests": args.requests, "budgets": budgets, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "dtype": args.dtype, "schedule": args.schedule, "repeats": args.repeats,
            "experts_kernel": bool(args.experts_kernel), "max_num_seqs": args.max_num_seqs}
    code, results = run_worker("moetailor.bench.vllm_k", spec)
    if code != 0 or results is None:
        raise RuntimeError(f"the benchmark's worker failed (exit {code}); its log is above")
    report = {"split": str(split), "budgets": budgets, "full_budget": full, "schedule": args.schedule,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "dtype": args.dtype,
              "experts_kernel": bool(args.experts_kernel), "max_num_seqs": args.max_num_seqs,
              "results": results, "command": "moetailor " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print_report(report, args.slo)
    return 0


def print_report(report: dict, slo: float) -> None:
    from ..tables import print_table

    ns = sorted({int(n) for r in report["results"].values() for n in r})
    rows = []
    for n in ns:
        f, k = report["results"]["fifo"][str(n)], report["results"]["k-aware"][str(n)]
        rows.append((n, f"{f['tok_s']:.0f}", f"{f['user_p50']:.1f}", f"{f['user_p10']:.1f}", f"{k['tok_s']:.0f}",
                     f"{k['user_p50']:.1f}", f"{k['user_p10']:.1f}", f"{k['tok_s'] / f['tok_s']:.2f}x"))
    print_table(f"vLLM, split checkpoint, budgets {report['budgets']} of {report['full_budget']} cycled, "
                f"{report['new_tokens']} new tokens, at most {report.get('max_num_seqs', 'N')} per step, "
                f"{report['dtype']}, k-aware = {report['schedule']}"
                + (", moetailor's experts kernel" if report.get("experts_kernel") else ""),
                ["requests", "fifo tok/s", "user p50", "user p10", "k-aware tok/s", "user p50", "user p10",
                 "k-aware / fifo"], rows)
    at = []
    for sched in SCHEDULERS:
        ok = [r["tok_s"] for r in report["results"][sched].values() if r["user_p10"] >= slo]
        at.append((sched, f"{max(ok):.0f}" if ok else "none meets it"))
    print_table(f"best machine tokens/s with the slowest 10% of users at >= {slo:g} tokens/s", ["scheduler", "tok/s"], at)


def _trace(llm, n: int, budgets: list[int], prompts: list[list[int]], new_tokens: int) -> dict:
    """One timed trace: n requests submitted at once, budgets cycled in arrival order."""
    import statistics

    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                             extra_args={"expert_top_k": budgets[i % len(budgets)]}) for i in range(n)]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    users = sorted((new_tokens - 1) / max(1e-9, o.metrics.last_token_ts - o.metrics.first_token_ts) for o in outs)
    return {"wall_s": wall, "tok_s": n * new_tokens / wall, "user_p50": statistics.median(users),
            "user_p10": users[max(0, int(0.1 * len(users)) - 1)] if len(users) >= 10 else users[0]}


def worker(spec: dict) -> dict:
    """Both schedulers' engines alive in this process, timed in turn, the order swapping every round."""
    import random

    from transformers import AutoConfig
    from vllm import LLM

    from ..integrations.vllm.launch import engine_kwargs
    from ..integrations.vllm.scheduler import scheduler_kwargs
    from .vllm import IDLE_S

    ns = [int(n) for n in spec["requests"].split(",")]
    common = dict(dtype=spec["dtype"], kv_cache_mib=1024, max_num_seqs=spec["max_num_seqs"],
                  experts_kernel=spec["experts_kernel"],
                  max_model_len=spec["prompt_tokens"] + spec["new_tokens"] + 8, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, max(ns) * spec["prompt_tokens"]), disable_log_stats=False)
    engines = {}
    for sched in SCHEDULERS:
        kwargs = engine_kwargs(spec["split"], **common)
        if sched == "k-aware":   # merged: the experts kernel's switch lives in additional_config too
            kwargs.update(scheduler_kwargs(spec["schedule"], additional_config=kwargs.get("additional_config")))
        engines[sched] = LLM(**kwargs)
    vocab = AutoConfig.from_pretrained(spec["split"], local_files_only=True).vocab_size
    rng = random.Random(0)
    results: dict[str, dict] = {sched: {} for sched in SCHEDULERS}
    for n in ns:
        for rnd in range(spec["repeats"] + 1):   # round 0 warms up
            prompts = [[rng.randrange(3, vocab) for _ in range(spec["prompt_tokens"])] for _ in range(n)]
            order = SCHEDULERS if rnd % 2 == 0 else SCHEDULERS[::-1]
            for sched in order:
                time.sleep(IDLE_S)   # the other engine's worker busy-polls for 1 s after its last step
                row = _trace(engines[sched], n, spec["budgets"], prompts, spec["new_tokens"])
                best = results[sched].get(str(n))
                if rnd and (best is None or row["wall_s"] < best["wall_s"]):
                    results[sched][str(n)] = row
            print(f"[N={n}] round {rnd}: " + ", ".join(f"{s} {results[s][str(n)]['tok_s']:.0f} tok/s"
                                                    for s in SCHEDULERS if str(n) in results[s]),
                  file=sys.stderr, flush=True)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
