"""`moetailor plan STATS --criterion C (--keep R | --keep-experts N | --layers SPEC) --out plan.json`."""
from __future__ import annotations

from .calibrate import command_line
from ..tables import print_table


def register(sub) -> None:
    from ..plans.criteria import CRITERIA, PLAN_PHASES

    p = sub.add_parser("plan", help="choose the experts to keep per layer from calibration statistics -> plan.json")
    p.add_argument("stats", help="statistics file from `moetailor calibrate`")
    p.add_argument("--criterion", required=True, choices=list(CRITERIA), metavar="CRITERION",
                   help="one of: " + ", ".join(CRITERIA))
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--keep", type=float, help="ratio of experts kept per layer (e.g. 0.5)")
    budget.add_argument("--keep-experts", type=int, help="experts kept per layer (e.g. 32)")
    p.add_argument("--layers", help="per-layer budgets: '0-2:48,3-5:24' (decoder layer ranges) or a JSON list with "
                   "one count per MoE layer; overrides --keep/--keep-experts where given")
    p.add_argument("--phase", choices=PLAN_PHASES, default="decode",
                   help="phase the pruning applies to (default decode: full pool for prefill)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random criterion")
    p.add_argument("--model", help="optional: check the statistics against this model first")
    p.add_argument("--out", required=True, help="plan file to write (.json)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..calibration import ExpertStats
    from ..models import resolve_model_path
    from ..outputs import check_output
    from ..plans.criteria import make_plan

    check_output(args.out, overwrite=args.overwrite,
                 inputs=(args.stats, resolve_model_path(args.model) if args.model else None))
    stats = ExpertStats.load(args.stats)
    model = None
    if args.model:
        from ..models import load_model
        model = load_model(args.model)
    command = command_line(args, positional=("stats",))
    plan = make_plan(stats, model, args.criterion, keep=args.keep, keep_experts=args.keep_experts, layers=args.layers,
                     phase=args.phase, seed=args.seed, stats_path=str(args.stats), command=command)
    plan.save(args.out)
    policy = plan.decode if args.phase != "prefill" else plan.prefill
    E = stats.model["num_experts"]
    rows = [(i, f"{len(p.keep)}/{E}", " ".join(map(str, p.keep)) if len(p.keep) <= 24 else
             " ".join(map(str, p.keep[:24])) + " ...") for i, p in sorted(policy.layers.items())]
    print_table(f"plan ({args.criterion}, phase {args.phase}) -> {args.out}", ["layer", "kept", "expert ids"], rows)
    return 0

