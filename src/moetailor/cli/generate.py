"""`moetailor generate MODEL --prompt ...`: run prompts through the phase-aware engine.

Prefill always runs the model's full router unless ``--plan`` says otherwise; ``--decode-plan``
applies a plan's decode policy to decode steps only (colocated), ``--decode-model`` decodes on a
pruned checkpoint in a separate worker process (disaggregated).
"""
from __future__ import annotations

import argparse

from .options import TORCH_NAMES as DTYPES
from .options import add_dtype_option, dtype_value


def set_threads(threads: int | None) -> None:
    """``--threads N``: torch intra-op threads (None: torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be at least 1 (got {threads}); omit it to use every core")
    import torch
    torch.set_num_threads(threads)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by `generate` and `serve`."""
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--decode-plan", metavar="PLAN", help="plan JSON whose decode policy runs on decode steps "
                      "(prefill keeps the full router)")
    pool.add_argument("--plan", metavar="PLAN", help="plan JSON applied as written (its prefill and decode policies)")
    pool.add_argument("--decode-model", metavar="DIR", help="pruned checkpoint (from `moetailor prune`) for a "
                      "separate decode worker process (disaggregated serving)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="weights + KV cache budget; the KV pool gets what the weights leave")
    add_dtype_option(p, "weights and KV cache", "fp32")
    add_dtype_option(p, "autocast dtype for prefill steps (bf16 pays for long prompts on AMX CPUs)", None,
                     flag="--prefill-dtype", allowed=tuple(DTYPES))
    p.add_argument("--decode-expert-dtype", type=dtype_value(tuple(DTYPES)), default=None, metavar="{fp32,bf16,fp16}",
                   help="expert weights of decode steps in this dtype (a copy; bf16 streams faster than fp32 on "
                        "AVX-512 BF16 CPUs: measure with `python -m moetailor.bench.kernels`)")
    p.add_argument("--experts-impl", choices=("grouped", "loop"), default="grouped",
                   help="expert execution where the native kernels do not run: one grouped GEMM per projection, or "
                        "a loop over the routed experts")
    p.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                   help="decode with torch's ops only, not moetailor's compiled CPU kernels (experts, paged attention)")
    p.add_argument("--compile-decode", action="store_true",
                   help="decode steps through torch.compile (about 30 s of compiling at the first steps) instead of "
                        "the engine's own decoder: may pay on checkpoints that decoder does not cover (DeepSeek, "
                        "fp32 OLMoE / Mixtral); beside it, on bf16 Qwen-MoE / OLMoE / Mixtral and fp32 Qwen-MoE, it "
                        "measured 0.87-1.03x (docs/benchmarks.md)")
    p.add_argument("--k-schedule", choices=("mixed", "max", "lanes", "tiers"), default="mixed",
                   help="how requests with different expert_top_k budgets share steps: mixed (one step, each "
                        "token at its own k), max (each step at its largest k), lanes (online low/high-k "
                        "decode lanes), tiers (offline k tiers; generate only)")
    p.add_argument("--decode-pools-by-load", metavar="PLAN", nargs="+", default=None,
                   help="decode pools that follow the load: plans (smaller expert pools) that decode steps switch "
                        "to as the decode batch grows; the full pool runs while its estimated step time meets "
                        "--step-slo-ms")
    p.add_argument("--step-slo-ms", type=float, default=None,
                   help="per-step decode time target (ms) that sets the --decode-pools-by-load thresholds")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="with --decode-model: seconds a worker may send no heartbeat before it is treated as hung "
                        "(killed, its requests ended with an error, replaced)")
    from .options import add_device_option
    add_device_option(p, default="cpu", what="where the engine runs")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    from .techniques import add_policy_arguments
    add_policy_arguments(p)   # --prefill-policy / --decode-policy / --fold-stats (folding, skipping)


def build_engine(args):
    """An LLM (colocated) or DisaggregatedLLM from the shared options."""
    import torch

    from ..models.loading import resolve_model_path
    from ..plans.plan import Plan
    from ..serving import LLM

    if args.step_slo_ms is not None and not getattr(args, "decode_pools_by_load", None):
        raise ValueError("--step-slo-ms sets the thresholds of --decode-pools-by-load; pass the pools' plans with "
                         "--decode-pools-by-load PLAN [PLAN ...], or drop --step-slo-ms")
    set_threads(args.threads)
    resolve_model_path(args.model)
    if args.decode_model:
        resolve_model_path(args.decode_model)   # a clear error here, not a worker that dies while loading
    def torch_dtype(name: str | None):
        return getattr(torch, DTYPES[name]) if name else None

    if args.dtype == "auto":
        from ..models.checkpoint import stored_dtype
        dtype = stored_dtype(resolve_model_path(args.model))
    else:
        dtype = torch_dtype(args.dtype)
    kwargs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, dtype=dtype, device=args.device,
                  max_model_len=args.max_model_len, experts_impl=args.experts_impl,
                  native_kernels=getattr(args, "native_kernels", True),
                  compile_decode=getattr(args, "compile_decode", False),
                  k_schedule=getattr(args, "k_schedule", "mixed"),
                  memory_budget=int(args.memory_budget_mb * 2**20) if args.memory_budget_mb else None,
                  prefill_dtype=torch_dtype(args.prefill_dtype),
                  decode_expert_dtype=torch_dtype(getattr(args, "decode_expert_dtype", None)))
    if args.decode_model:
        from ..serving.disagg import DisaggregatedLLM
        return DisaggregatedLLM(args.model, decode_model=args.decode_model, threads=args.threads,
                                heartbeat_timeout=getattr(args, "heartbeat_timeout", 10.0), **kwargs)
    plan = (Plan.load(args.decode_plan).phase_aware() if args.decode_plan
            else Plan.load(args.plan) if args.plan else None)
    llm = LLM(args.model, plan, **kwargs)
    from .techniques import apply_policy_arguments
    apply_policy_arguments(llm, args)
    if getattr(args, "decode_pools_by_load", None):
        from ..serving.load_pools import PoolsByLoad
        if args.step_slo_ms is None:
            raise ValueError("--decode-pools-by-load needs --step-slo-ms (the decode step time the full pool must meet)")
        pools = [None] + [Plan.load(path) for path in args.decode_pools_by_load]
        llm.set_decode_pools(PoolsByLoad.from_slo(pools, llm.budgets.cost, args.step_slo_ms / 1e3, llm.budgets.full_k,
                                                  args.max_num_seqs))
    return llm


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with the phase-aware engine (full prefill, planned decode)")
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--expert-top-k", type=int, default=None, help="active experts per token for these requests")
    p.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    import collections
    import time

    from ..serving import SamplingParams
    from ..tables import print_table

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                            expert_top_k=args.expert_top_k)
    llm = build_engine(args)
    try:
        start = time.perf_counter()
        outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
        seconds = time.perf_counter() - start
        for out in outputs:
            print(f"--- prompt: {out.prompt!r}")
            print(f"{out.text}")
            if out.error:
                print(f"[error: {out.error}]")
        if hasattr(llm, "sync_stats"):    # disaggregated: the workers' step records arrive with their reports
            llm.sync_stats()
        decode = [r for r in llm.step_log if r.phase == "decode"]
        dsec = sum(r.seconds for r in decode)
        dtok = sum(r.num_seqs for r in decode)
        distinct = [sum(r.distinct_experts.values()) / max(1, len(r.distinct_experts)) for r in decode]
        rows = [("requests", len(outputs)),
                ("completion tokens", sum(len(o.token_ids) for o in outputs)),
                ("wall time (s)", f"{seconds:.2f}"),
                ("decode tokens/s", f"{dtok / dsec:.1f}" if dsec else "-"),
                ("distinct experts per layer per decode step (mean)",
                 f"{sum(distinct) / len(distinct):.1f}" if distinct else "-"),
                ("finish reasons", ", ".join(sorted({str(o.finish_reason) for o in outputs})))]
        pools = collections.Counter(r.pool_size for r in decode if r.pool_size is not None)
        if pools:   # --decode-pools-by-load: which pool each decode step ran
            rows.append(("decode steps per pool (experts per layer)",
                         ", ".join(f"{size}: {n}" for size, n in sorted(pools.items(), reverse=True))))
        print_table(f"moetailor generate {args.model}", ["measure", "value"], rows)
    finally:
        close = getattr(llm, "close", None)
        if close:
            close()
    return 0
