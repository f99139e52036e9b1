"""`moetailor tune MODEL --data TRAFFIC --min-quality 0.97 --budget 0.5 --out DIR`: the plan to serve
for the user's traffic, the Pareto front it was chosen from, and the evidence per point."""
from __future__ import annotations

from pathlib import Path

from ..tables import print_table
from .options import add_backend_options, add_device_option, add_dtype_option, add_overwrite_option, invocation


def register(sub) -> None:
    from ..tuning.search import CRITERIA, SERVABLE

    p = sub.add_parser("tune", help="search plans (criteria, pool sizes, per-layer sizes, folding, top-k, optional "
                       "distillation) for one that keeps a quality floor on your traffic at a budget or speed (the best "
                       "quality there; else the cheapest meeting the floor and the best at the target); writes the "
                       "plan, the Pareto front (table, PNG) and the evidence per point")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    p.add_argument("--data", default=None,
                   help="your traffic, as for `calibrate --data`: FILE.jsonl (\"text\", \"prompt\"+\"completion\", chat "
                   "\"messages\", or \"prompt\"+\"answer\" lines: then also the tasks, calibrated on the full model's "
                   "own answers) | FILE.txt | tasks | text | mix | ... (default for the bundled models: tasks)")
    p.add_argument("--tasks", default=None, help="prompts with answers for --min-quality, as for `eval --tasks` "
                   "(default: --data when it holds prompt/answer lines; 'all' for a bundled model on tasks)")
    floor = p.add_argument_group("quality floor (one or both)")
    floor.add_argument("--min-quality", type=float, default=None,
                       help="share of the full model's task accuracy to keep, e.g. 0.97; a plan meets it only when "
                       "the paired 95%% interval of its share lies above it (else: misses, or not enough prompts to "
                       "tell, with the --n that would decide)")
    floor.add_argument("--max-kl", type=float, default=None,
                       help="bound on next-token KL to the full model on held-out traffic text (nats/token)")
    target = p.add_argument_group("target (one)")
    target.add_argument("--budget", type=float, default=None,
                        help="share of routed expert weights a decode step may read at --batch, e.g. 0.5")
    target.add_argument("--min-tok-s", type=float, default=None,
                        help="decode tokens/s at --batch: measured with the engine here, or projected with --gpu")
    target.add_argument("--gpu", default=None, help="project --min-tok-s on this GPU (as `bench project`)")
    target.add_argument("--model-shape", default=None, help="with --gpu: the model shape to project (bench project)")
    target.add_argument("--context", type=int, default=1024, help="with --gpu: mean context per sequence")
    p.add_argument("--batch", type=int, default=64, help="decode batch the budget and speed are taken at (default 64)")
    search = p.add_argument_group("search space")
    search.add_argument("--criteria", default=",".join(CRITERIA), help="criteria to compare (default: all four)")
    search.add_argument("--no-fold", action="store_true", help="leave folding out")
    novice = search.add_mutually_exclusive_group()
    novice.add_argument("--novice", action="store_true", default=None,
                        help="require novice pools (dropped experts replaced by their mean outputs, MoNE): refuse a "
                        "--vllm-url server that cannot switch them in (default: searched wherever the evaluator "
                        "runs them, else skipped with a note)")
    novice.add_argument("--no-novice", dest="novice", action="store_false", default=None, help="leave novice pools out")
    search.add_argument("--no-merge", action="store_true", help="leave merged experts (HC-SMoE, M-SMoE; served as "
                        "merged checkpoints) out")
    search.add_argument("--protect-super", type=int, default=8, metavar="N",
                        help="also try the pools near the target with the model's N super experts protected "
                        "(default 8; 0 = never)")
    search.add_argument("--no-allocation", action="store_true", help="leave per-layer sizes from sensitivity out")
    search.add_argument("--no-top-k", action="store_true", help="leave top-k reduction out")
    search.add_argument("--servable", choices=SERVABLE, default="engine",
                        help="engine (default: every technique) or vllm (what vLLM serves phase-aware: masked and "
                             "folded pools, novice pools and top-k through its plugin, merged experts as a decode "
                             "checkpoint; no distilled decoder)")
    search.add_argument("--distill", type=int, default=0, metavar="STEPS",
                        help="also distil the best plan at the target for STEPS steps (heavy; 0 = off)")
    search.add_argument("--distill-lr", type=float, default=1e-3)
    cost = p.add_argument_group("proxy and evaluation sizes")
    cost.add_argument("--calib-tokens", type=int, default=200_000, help="calibration tokens (default 200000)")
    cost.add_argument("--kl-tokens", type=int, default=4096, help="held-out traffic tokens per KL score (default 4096)")
    cost.add_argument("--kl-window", type=int, default=128)
    cost.add_argument("--n", type=int, default=50, help="prompts per task for accuracy (a file: its first N lines)")
    cost.add_argument("--evaluate", type=int, default=8, help="candidates given the full task evaluation (default 8)")
    cost.add_argument("--no-confirm", action="store_true",
                      help="state the chosen plan's verdict on the prompts that picked it, not on as many fresh ones "
                           "(optimistic: the best of several on one prompt set looks better there than it is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                   help="score layer by layer from the shards (auto: when the model does not fit in memory)")
    add_dtype_option(p, "working dtype for calibration and scoring", None,
                     default_words="default: fp32, as `eval` and `serve` compute, so the verdicts are theirs; the "
                                   "checkpoint's stored dtype where only that fits in memory")
    add_device_option(p)
    add_backend_options(p)
    p.add_argument("--out", required=True, help="output folder (an earlier run's cache there is reused)")
    add_overwrite_option(p, help="recompute cached results that do not fit this run")
    p.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    from ..calibration.data import default_data_spec
    from ..tuning.report import rows
    from ..tuning.search import Tuner, TuneSettings

    data = default_data_spec(args.model, args.data)
    command = invocation("tune") or ""
    settings = TuneSettings(
        model=args.model, data=data, out=Path(args.out), tasks=args.tasks, min_quality=args.min_quality,
        max_kl=args.max_kl, budget=args.budget, min_tok_s=args.min_tok_s, gpu=args.gpu, model_shape=args.model_shape,
        context=args.context, batch=args.batch, criteria=tuple(c.strip() for c in args.criteria.split(",") if c.strip()),
        fold=not args.no_fold, novice=args.novice, merge=not args.no_merge,
        protect_super=args.protect_super, allocation=not args.no_allocation, top_k=not args.no_top_k, servable=args.servable,
        calib_tokens=args.calib_tokens, kl_tokens=args.kl_tokens, kl_window=args.kl_window, n=args.n,
        evaluate=args.evaluate, confirm=not args.no_confirm, distill_steps=args.distill, distill_lr=args.distill_lr,
        seed=args.seed,
        stream=args.stream, dtype=args.dtype, device=str(args.device), overwrite=args.overwrite, command=command,
        backend=args.backend, vllm_url=args.vllm_url)
    tuner = Tuner(settings)
    result = tuner.run()
    cols, table = rows(tuner, result, result.front)
    target = (f"budget {settings.budget:g}" if settings.budget is not None else
              f">= {settings.min_tok_s:g} tok/s" if settings.min_tok_s is not None else "no target")
    floor = " and ".join(x for x in (f">= {settings.min_quality:.0%} of the full model's accuracy"
                                     if settings.min_quality is not None else None,
                                     f"KL <= {settings.max_kl:g}" if settings.max_kl is not None else None) if x)
    s = result.summary
    evaluated = (f"{len(result.points) - 1} evaluated on {s['prompts']} prompts" if result.quality == "accuracy"
                 else "the floor is the held-out KL")
    print_table(f"Pareto front ({result.quality} vs budget at batch {settings.batch}; {s['candidates_scored']} plans "
                f"scored by held-out traffic KL, {evaluated}; {s['seconds']:.0f} s) -> {args.out}", cols, table)
    for note in s.get("notes") or []:
        print(f"note: {note}")
    c = result.choice
    per_task = max(1, len(s.get("tasks") or [])) if result.quality == "accuracy" else None

    def evidence(r: dict) -> str:
        """The floor verdict of a point: its share of full with the 95% interval, or its KL."""
        if r.get("floor") is not None:
            from ..eval.metrics import FloorVerdict
            picked = FloorVerdict.from_json(r["floor"])
            if (r.get("fresh") or {}).get("floor") is None:
                return picked.describe(per_task)
            fresh = FloorVerdict.from_json(r["fresh"]["floor"])
            return f"on fresh prompts {fresh.describe(per_task)}; on the prompts that picked it {picked.interval()}"
        return f"KL {r['kl']:.4f}"

    def where(r: dict, plan: str) -> str:
        """How a point is served: a distilled or merged decoder is a checkpoint, else its plan file."""
        return f"--decode-model {r.get('distilled') or r['merged']}" if r.get("distilled") or r.get("merged") else plan

    if c.met:
        r = c.chosen
        print(f"chosen: {r['label']} (budget {r['budget']:.3f}) meets {floor} at {target} "
              f"({evidence(r)}) -> {r['distilled'] if r.get('distilled') else result.plan_path}")
        if r.get("distilled"):    # a distilled decoder is a checkpoint that carries its plan
            print(f"serve it: moetailor serve {args.model} --decode-model {r['distilled']}   |   vLLM: a distilled "
                  "decoder, which vLLM's plugin does not serve; rerun with --servable vllm")
            return 0
        if r.get("merged"):      # a merged decoder is a stock checkpoint
            print(f"serve it: moetailor serve {args.model} --decode-model {r['merged']}   |   vLLM: moetailor serve "
                  f"{args.model} --backend vllm --decode-model {r['merged']} (a stock checkpoint: plain vLLM loads it)")
            return 0
        print(f"serve it: moetailor serve {args.model} --decode-plan {result.plan_path}   |   vLLM: "
              f"additional_config={{\"moetailor_decode_plan\": \"{result.plan_path}\"}}")
        return 0
    proven = result.quality == "accuracy" and settings.min_quality is not None
    prompts = s.get("fresh_prompts") or s["prompts"]
    fresh = "fresh " if s.get("fresh_prompts") else ""
    print(f"no plan {'is proven to meet' if proven else 'meets'} {floor} at {target}"
          + (f" (95% confidence, {prompts} {fresh}prompts)." if proven else "."))
    out = Path(args.out)
    best = c.best_at_target
    if best is not None:
        from ..eval.metrics import UNDECIDED
        what = "pick, with that caveat" if tuner.floor_verdict(best) == UNDECIDED else "best quality at the target"
        print(f"  {what}: {best['label']} (budget {best['budget']:.3f}): {evidence(best)} "
              f"-> {where(best, str(out / 'best-at-target.json'))}")
    else:
        print("  no evaluated plan reaches the target")
    if c.cheapest_meeting_floor is not None:
        r = c.cheapest_meeting_floor
        plan = "the full model" if r["label"] == "full model" else str(out / "cheapest-meeting-floor.json")
        print(f"  cheapest plan meeting the floor: {r['label']} (budget {r['budget']:.3f}) -> {where(r, plan)}")
    else:
        print("  no evaluated plan meets the floor")
    return 1
