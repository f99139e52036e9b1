"""`moetailor plan STATS --criterion C (--keep R | --keep-experts N | --layers SPEC) --out plan.json`."""
from __future__ import annotations

from .calibrate import command_line
from ..tables import print_table


def register(sub) -> None:
    from ..plans.criteria import CRITERIA, GROUP_MODES, PLAN_PHASES

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
    p.add_argument("--groups", choices=GROUP_MODES, default="balanced",
                   help="grouped routers (DeepSeek n_group > 1): keep the same number of experts in every routing "
                   "group, ranked inside each group (balanced, default; `moetailor prune` can write it), or rank "
                   "all experts together (ignore; masked serving only)")
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
                     phase=args.phase, seed=args.seed, stats_path=str(args.stats), command=command,
                     groups=args.groups)
    plan.save(args.out)
    policy = plan.decode if args.phase != "prefill" else plan.prefill
    E = stats.model["num_experts"]
    rows = [(i, f"{len(p.keep)}/{E}", " ".join(map(str, p.keep)) if len(p.keep) <= 24 else
             " ".join(map(str, p.keep[:24])) + " ...") for i, p in sorted(policy.layers.items())]
    headers, title = ["layer", "kept", "expert ids"], f"plan ({args.criterion}, phase {args.phase}) -> {args.out}"
    groups, notes = plan.meta.get("groups"), []
    if groups:
        headers.insert(2, "per group")
        rows = [(i, kept, " ".join(map(str, groups["per_group"][str(i)])), ids) for i, kept, ids in rows]
        notes.append(f"grouped router: {groups['n_group']} groups, top {groups['topk_group']} per token; " +
                     ("the same count kept in every group, ranked inside each group" if groups["mode"] == "balanced"
                      else "groups ignored: masked serving only (`moetailor prune` refuses this plan)"))
        for i, dead in groups.get("unreachable", {}).items():
            notes.append(f"layer {i}: experts {dead} are alone in their group, whose score (sum of its top-2 kept "
                         "experts) is then -inf: the masked router never selects them")
    print_table(title, headers, rows)
    for note in notes:
        print(note)
    return 0

