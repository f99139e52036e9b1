"""`moetailor plan STATS --criterion C (--keep R | --keep-experts N | --layers SPEC) --out plan.json`."""
from __future__ import annotations

from ..memory import peak_rss_gib
from ..tables import print_table
from .calibrate import command_line
from .options import add_overwrite_option


def register(sub) -> None:
    from ..plans.criteria import CRITERIA, GROUP_MODES, PLAN_PHASES

    p = sub.add_parser("plan", help="choose the experts to keep per layer from calibration statistics -> plan.json")
    p.add_argument("stats", help="statistics file from `moetailor calibrate`")
    p.add_argument("--criterion", choices=list(CRITERIA), metavar="CRITERION",
                   help="one of: " + ", ".join(CRITERIA) + " (required, except with --merge: frequency)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--keep", type=float, help="ratio of experts kept per layer (e.g. 0.5)")
    budget.add_argument("--keep-experts", type=int, help="experts kept per layer (e.g. 32)")
    p.add_argument("--layers", help="per-layer budgets: '0-2:48,3-5:24' (decoder layer ranges) or a JSON list with "
                   "one count per MoE layer; overrides --keep/--keep-experts where given. 'search': the --keep "
                   "total, moved between layers by measured sensitivity (next-token KL on --search-data; needs --model)")
    p.add_argument("--search-data", default=None, help="with --layers search: text to score on (default for "
                   "'reference': tasks; required otherwise)")
    p.add_argument("--search-tokens", type=int, default=None,
                   help="with --layers search: tokens scored per allocation (default 4096)")
    p.add_argument("--step", type=int, default=None, help="with --layers search: experts moved per transfer (default 4)")
    p.add_argument("--phase", choices=PLAN_PHASES, default="decode",
                   help="phase the pruning applies to (default decode: full pool for prefill)")
    p.add_argument("--groups", choices=GROUP_MODES, default="balanced",
                   help="grouped routers (DeepSeek n_group > 1): keep the same number of experts in every routing "
                   "group, ranked inside each group (balanced, default; `moetailor prune` can write it), or rank "
                   "all experts together (ignore; masked serving only)")
    p.add_argument("--protect-super", type=int, default=0, metavar="N",
                   help="keep the model's N super experts whatever their score: the experts whose largest output "
                   "magnitude most exceeds their layer's median (model-wide ranking), each taking one of its "
                   "layer's kept places (needs statistics from this moetailor's `calibrate`)")
    p.add_argument("--novice", action="store_true",
                   help="replace the dropped experts by their mean outputs (MoNE novice experts: the full router's "
                   "choice, g * c_e added for a dropped expert, no weights read) instead of masking them")
    p.add_argument("--merge", choices=("hcsmoe", "msmoe"), default=None,
                   help="merge every layer's experts into the kept count instead of dropping the rest: hcsmoe "
                   "(HC-SMoE: hierarchical clustering of the experts' mean outputs), msmoe (M-SMoE: the most "
                   "frequent experts (--criterion) are dominant, the others join the one with the most similar "
                   "router row; needs --model). Members are averaged weighted by routing frequency; `moetailor "
                   "prune` writes the stock checkpoint with fewer experts")
    p.add_argument("--merge-router", choices=("dominant", "weighted"), default="dominant",
                   help="with --merge: a merged expert's router row is its most frequent member's (dominant, "
                   "default) or the frequency-weighted average of its members' rows (weighted)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random criterion")
    p.add_argument("--model", help="optional: check the statistics against this model first")
    p.add_argument("--out", required=True, help="plan file to write (.json)")
    add_overwrite_option(p, help="replace --out if it exists")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..calibration import ExpertStats
    from ..models import resolve_model_path
    from ..outputs import check_output
    from ..plans.criteria import make_plan

    check_output(args.out, overwrite=args.overwrite,
                 inputs=(args.stats, resolve_model_path(args.model) if args.model else None))
    if args.criterion is None:
        if not args.merge:
            raise ValueError("give --criterion (one of: frequency, mass, ean, weighted-ean, reap, mone, random, ...)")
        args.criterion = "frequency"
    if args.merge_router != "dominant" and not args.merge:
        raise ValueError("--merge-router applies to merged plans: add --merge hcsmoe|msmoe")
    stats = ExpertStats.load(args.stats)
    command = command_line(args, positional=("stats",))
    if args.layers == "search":   # measures each layer's sensitivity: runs the whole model
        if args.merge:
            raise ValueError("--layers search does not take --merge (a merged layer is another checkpoint); give "
                             "--keep / --layers")
        from ..models import load_model
        return run_search(args, stats, load_model(args.model) if args.model else None, command)
    model = None
    if args.model:   # only its routers are read (a meta-device skeleton): any size fits
        from ..models.checkpoint import skeleton
        model, _ = skeleton(args.model)
    plan = make_plan(stats, model, args.criterion, keep=args.keep, keep_experts=args.keep_experts, layers=args.layers,
                     phase=args.phase, seed=args.seed, stats_path=str(args.stats), command=command,
                     groups=args.groups, protect_super=args.protect_super, novice=args.novice, merge=args.merge,
                     merge_router=args.merge_router)
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
    for i, ids in plan.meta.get("super_experts", {}).items():
        notes.append(f"layer {i}: super experts {ids} protected")
    if args.novice:
        notes.append("dropped experts are replaced by their mean outputs (novice experts)")
    if args.merge:
        sizes = [len(g) for p in policy.layers.values() for g in p.merge]
        notes.append(f"merged ({args.merge}, router rows: {args.merge_router}): the kept ids are the groups' "
                     f"representatives; groups of {min(sizes)}-{max(sizes)} experts; write the checkpoint with "
                     "`moetailor prune MODEL PLAN --out DIR`")
    for note in notes:
        print(note)
    print(f"peak RSS {peak_rss_gib():.2f} GiB" + (" (read only the routers of --model)" if args.model else ""))
    return 0


def run_search(args, stats, model, command: str) -> int:
    from ..calibration.data import default_data_spec
    from ..eval.search_k import search_pool
    from ..models import load_tokenizer

    if model is None or args.keep is None:
        raise ValueError("--layers search needs --model (to measure each layer's sensitivity) and --keep (the total)")
    data = default_data_spec(args.model, args.search_data, "--search-data")
    plan, summary = search_pool(model, load_tokenizer(args.model), stats, args.criterion, args.keep, data=data,
                                tokens=args.search_tokens or 4096, step=args.step or 4, phase=args.phase, seed=args.seed,
                                stats_path=str(args.stats), command=command, novice=args.novice,
                                protect_super=args.protect_super)
    plan.save(args.out)
    s = summary["search"]
    kind = args.criterion + (", novice constants" if args.novice else "")
    print_table(f"per-layer pool sizes ({kind}, {args.keep:g} of experts on average, step {summary['step']}) "
                f"-> {args.out}", ["MoE layer", "uniform", "searched"],
                [(i, u, k) for i, u, k in zip(stats.model["moe_layers"], s["uniform"], s["ks"])])
    print(f"next-token KL to the full model on {summary['tokens']:,} tokens of {summary['data']}: "
          f"{s['uniform_kl']:.4f} uniform -> {s['kl']:.4f} searched ({s['evaluations']} allocations scored, "
          f"{summary['seconds']:.0f} s); peak RSS {peak_rss_gib():.2f} GiB")
    return 0
