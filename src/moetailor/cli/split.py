"""`moetailor split MODEL --parts N --data SPEC --out DIR`: MoE-Prism sub-expert splitting.

Writes a stock checkpoint of the same architecture with N x the experts, 1/N the expert width and
N x the top-k; requests then choose 1..N*k sub-experts per token (``expert_top_k``).
"""
from __future__ import annotations

from ..tables import print_table
from .options import add_device_option, add_overwrite_option, invocation


def register(sub) -> None:
    p = sub.add_parser("split", help="split every expert into N co-activated sub-experts (elastic per-request k)")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    p.add_argument("--parts", type=int, required=True, help="N: sub-experts per expert (must divide the expert width)")
    p.add_argument("--data", default=None, help="calibration data spec, as for `moetailor calibrate` (tasks | "
                   "text[:DOMAINS] | mix | FILE; default for the bundled models: tasks, their workload; required "
                   "otherwise)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--method", choices=("anneal", "random"), default="anneal",
                   help="neuron grouping: co-activation annealing (default) or a random equal split (baseline)")
    p.add_argument("--gate", choices=("exact", "proxy", "finetune"), default="proxy",
                   help="sub-expert router: exact (identical rows; full budget = original exactly), proxy "
                        "(training-free: heaviest parts first, default), finetune (proxy + router-only KL training)")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens for profiling (default 16384)")
    p.add_argument("--seq-len", type=int, default=256, help="calibration window length (default 256)")
    p.add_argument("--anneal-steps", type=int, default=4000, help="simulated-annealing swap steps per layer")
    p.add_argument("--finetune-steps", type=int, default=60, help="router training steps for --gate finetune")
    p.add_argument("--seed", type=int, default=0)
    add_device_option(p, what="where the model runs while it is profiled (and its router fine-tuned)")
    add_overwrite_option(p, help="replace --out if it exists")
    p.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    from ..transforms.split import split_checkpoint

    if args.tokens < 1:
        raise ValueError(f"--tokens must be at least 1 (got {args.tokens})")
    command = invocation()
    from ..calibration.data import default_data_spec
    from ..training.split_finetune import finetune_router

    out, result = split_checkpoint(args.model, default_data_spec(args.model, args.data), args.parts, args.out, method=args.method, gate=args.gate,
                                   tokens=args.tokens, seq_len=args.seq_len, steps=args.anneal_steps, seed=args.seed,
                                   overwrite=args.overwrite, finetune_steps=args.finetune_steps, command=command,
                                   device=args.device, finetune_router=finetune_router)
    cfg = result.model.config
    k = int(cfg.num_experts_per_tok)
    rows = [("experts per layer", f"{len(next(iter(result.layers.values())).groups)} -> "
                                  f"{len(next(iter(result.layers.values())).groups) * args.parts}"),
            ("top-k", f"{k // args.parts} -> {k} (per-request budget 1..{k})"),
            ("partition", args.method), ("gate", args.gate)]
    for i, o in sorted(result.meta.get("objective", {}).items(), key=lambda kv: int(kv[0])):
        rows.append((f"layer {i} co-activation J", f"{o['objective']:.2f} (random {o['random']:.2f})"))
    spreads = [s.spread for s in result.layers.values() if s.spread is not None]
    if spreads:
        rows.append(("proxy constant-direction spread", f"{min(spreads):.3f}..{max(spreads):.3f} (0 = exact)"))
    if "finetune" in result.meta:
        f = result.meta["finetune"]
        rows.append(("router fine-tune KL", f"{f['kl_first_cycle']:.4f} -> {f['kl_last_cycle']:.4f} ({f['steps']} steps)"))
    groups = result.meta.get("groups")
    if groups:
        rows.append(("routing groups", f"n_group {groups['n_group']} -> {groups['split_n_group']}, topk_group "
                                       f"{groups['topk_group']} -> {groups['split_topk_group']} (one sub-group per "
                                       "part of each group)"))
        share = " ".join(f"{i}:{a:.1%}" for i, a in groups["group_choice_agreement"].items())
        rows.append(("same groups chosen as the original", share))
    print_table(f"split checkpoint -> {out}", ["property", "value"], rows)
    return 0
