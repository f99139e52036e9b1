"""`moetailor eval MODEL [--plan PLAN | --sweep SPEC] --out DIR`: accuracy AND output length of
expert budgets, per task and configuration (baseline, pruned, reverse, phase-aware, ...)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..tables import print_table
from .calibrate import command_line
from .options import add_backend_options, add_device_option, add_dtype_option, add_overwrite_option, invocation


def register(sub) -> None:
    from ..eval.configurations import CONFIGURATIONS, PHASE_CONFIGURATIONS
    from ..eval.runner import SWEEPS

    p = sub.add_parser("eval", help="evaluate expert budgets: accuracy, output length, budget hits, held-out KL")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--plan", help="a plan JSON (from `moetailor plan`) to evaluate")
    src.add_argument("--sweep", help=f"calibrate once and sweep criteria x keep ratios: {', '.join(SWEEPS)}, or "
                                     "'criteria=frequency,reap;keep=0.5,0.25'")
    p.add_argument("--tasks", default="all",
                   help="'all', a comma-separated list of tasks, or a JSONL file of your own (one line per prompt: "
                        "prompt or messages, answer, match = exact|number|regex|contains; see docs/evaluation.md)")
    p.add_argument("--n", type=int, default=200, help="prompts per task and seed (default 200)")
    p.add_argument("--seeds", type=int, default=3, help="seeds: prompt sets (and sampling seeds) to average over")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first prompt set: seeds FIRST..FIRST+SEEDS-1 (e.g. prompts that did not pick the plan)")
    p.add_argument("--floor", type=float, default=None,
                   help="share of the full model's accuracy each configuration must keep (e.g. 0.97): a verdict per "
                        "row from the paired 95%% interval against the baseline configuration on the same prompts")
    p.add_argument("--sampling", default="greedy",
                   help="greedy, sample (temperature 1.0, top-p 0.95) or both: greedy,sample")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated configurations; registered: {', '.join(CONFIGURATIONS)} (default "
                        f"{','.join(PHASE_CONFIGURATIONS)}; for a --plan that keeps every expert, e.g. a per-layer "
                        "top-k plan from search-k: baseline,plan,phase-aware; for a merged plan: baseline,phase-aware, "
                        "decoded on its merged checkpoint)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max new tokens for every task (default: per task, 2x its longest reference answer)")
    p.add_argument("--kl-docs", type=int, default=2, help="held-out documents per text domain for KL/perplexity")
    p.add_argument("--kl-window", type=int, default=256, help="tokens per held-out window")
    p.add_argument("--calib-tokens", type=int, default=32768, help="calibration tokens for --sweep")
    p.add_argument("--calib-data", default=None,
                   help="calibration data for --sweep: the traffic to serve (FILE.jsonl, FILE.txt, tasks, tasks:TASK, "
                   "text, mix, mixture:...; default for the bundled models: tasks, required otherwise). A sweep axis "
                   "'data=tasks|text|mix' (or data=domains) calibrates per domain for the cross-domain matrix")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine batch size")
    add_backend_options(p)
    p.add_argument("--out", required=True, help="output directory (an interrupted run resumes from its cells; cells "
                   "another plan, model or setting wrote there are an error)")
    add_overwrite_option(p,
                   help="recompute the cells (and statistics) in --out that another plan, model or setting wrote, "
                        "and replace an existing --write-docs page")
    p.add_argument("--write-docs", default=None, help="also write a results page there (e.g. docs/results.md)")
    p.add_argument("--budgets", default=None, metavar="all|K,K,...",
                   help="MODEL is a split checkpoint: evaluate these sub-expert budgets (topk:K) against --original "
                        "at equal active parameters, and count usable operating points")
    p.add_argument("--original", default="reference", help="with --budgets: the model the split came from")
    p.add_argument("--metric", choices=("tasks", "kl"), default="tasks",
                   help="tasks (default): the task suite and held-out KL on a model in memory; kl: only held-out "
                        "KL and perplexity against the full MODEL, layer-streamed (any size; the quality number "
                        "for random-weight checkpoints), of --plan (masked on every token) or --pruned DIR")
    p.add_argument("--pruned", default=None, help="with --metric kl: a pruned checkpoint of MODEL to compare")
    add_dtype_option(p, "working dtype for --metric kl", "auto")
    add_device_option(p, what="where the model runs: the engine on one device for tasks, one layer at a time for "
                              "--metric kl")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="with --budgets: a budget is usable within this accuracy drop of the full budget (0.05)")
    p.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    from ..eval.configurations import parse_configs
    from ..eval.report import accuracy_spread, versus_full_cells, versus_full_columns, write_docs
    from ..eval.runner import EvalSettings, Sweep
    t0 = time.time()
    if args.backend != "engine" and (args.metric == "kl" or args.budgets):
        raise ValueError("--backend vllm evaluates the task suite and held-out KL of plans (--plan/--sweep); "
                         "--metric kl and --budgets run on moetailor's engine only")
    if args.metric == "kl":
        return run_kl(args)
    args.configs = plan_configs(args.plan, args.configs)
    if args.pruned:
        raise ValueError("--pruned is for --metric kl; evaluate a pruned checkpoint's tasks as MODEL instead")
    settings = EvalSettings(
        model=args.model, tasks=[e.strip() for e in args.tasks.split(",") if e.strip()], n=args.n, seeds=args.seeds,
        first_seed=args.first_seed, floor=args.floor,
        sampling=[s.strip() for s in args.sampling.split(",") if s.strip()], configs=parse_configs(args.configs),
        plan=args.plan, sweep=args.sweep, max_tokens=args.max_tokens, kl_docs=args.kl_docs,
        kl_window=args.kl_window, calib_tokens=args.calib_tokens, calib_data=args.calib_data, max_num_seqs=args.max_num_seqs,
        device=str(args.device), backend=args.backend, vllm_url=args.vllm_url)
    if args.budgets:   # the budget comparison brings its own topk configurations
        settings.configs = parse_configs("baseline")
        settings.validate()
        check_eval_outputs(args, (args.model, args.original))
        return run_budgets(args, settings, t0)
    settings.validate()  # bad input (a --sweep spec too) fails before the model loads
    check_eval_outputs(args, (args.model, args.plan))
    command = invocation("eval") or command_line(args, positional=("model",))   # called from Python: rebuilt
    results = Sweep(settings, args.out, command=command, log=lambda m: print(m, file=sys.stderr),
                    overwrite=args.overwrite).run()
    rows = [r for r in results["rows"] if r["task"] == "all"]
    scope = "all tasks" if settings.tasks == ["all"] else "tasks: " + ", ".join(settings.tasks)
    versus = versus_full_columns(results)
    print_table(f"moetailor eval {args.model} ({scope})",
                ["variant", "sampling", "accuracy %", *versus, "p50", "p90", "budget hit %", "EOS %", "KL", "ppl"],
                [(r["variant"], r["sampling"], f"{100 * r['accuracy']:.1f} ± {accuracy_spread(r)}",
                  *versus_full_cells(r, versus), f"{r['p50']:.0f}", f"{r['p90']:.0f}", f"{100 * r['budget_hit']:.1f}",
                  f"{100 * r['eos']:.1f}", f"{r['kl']:.3f}", f"{r['perplexity']:.2f}") for r in rows])
    guarded = [r for r in rows if r.get("guard")]
    if guarded:
        print_table("collapse guard (guarded:CONFIG rows)",
                    ["variant", "sampling", "trips", "rescued requests", "decode steps sent to full pool %",
                     "shadow steps %"],
                    [(r["variant"], r["sampling"], r["guard"]["trips"], sum(r["guard"]["rescued"].values()),
                      f"{100 * r['guard']['fallback_share']:.1f}", f"{100 * r['guard']['shadow_share']:.1f}")
                     for r in guarded])
    out = Path(args.out)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots in {time.time() - t0:.0f} s")
    if args.write_docs:
        print(f"wrote {write_docs(results, out, Path(args.write_docs), time.time() - t0)}")
    return 0


def plan_configs(plan_path: str | None, configs: str | None) -> str:
    """The configurations to run: as given, or by default the phase configurations, which are about
    pruning; a plan that keeps every expert (per-layer top-k, skipping) gets its own rows instead, and
    asking for `pruned`/`reverse` of it is an error that says what to run."""
    from ..eval.configurations import PHASE_CONFIGURATIONS
    from ..plans import Plan
    from ..plans.plan import describe_phase, prunes_experts

    if plan_path is None or not Path(plan_path).is_file():
        return configs or ",".join(PHASE_CONFIGURATIONS)
    plan = Plan.load(plan_path)
    if plan.merges:   # decoded on its merged checkpoint; prefill stays on the model
        return configs or "baseline,phase-aware"
    if prunes_experts(plan):
        return configs or ",".join(PHASE_CONFIGURATIONS)
    if configs is None:
        return "baseline,plan,phase-aware"
    named = {c.strip().split(":")[0] for c in configs.split(",")}
    wrong = sorted(named & {"pruned", "reverse"})
    if wrong:
        phase = "decode" if not plan.decode.is_identity else "prefill"
        raise ValueError(f"--plan {plan_path} keeps every expert ({phase}: {describe_phase(plan, phase)}), so "
                         f"{'/'.join(wrong)} (expert pruning in both phases / in prefill) would mislabel it; use "
                         "--configs baseline,plan,phase-aware (plan: as written; phase-aware: its policy on decode "
                         "steps only)")
    return configs


EVAL_ENTRIES = ("cells", "results.json", "budgets.json", "split", "original")   # what marks an eval folder


def check_eval_outputs(args, inputs) -> None:
    """Before any work: --out is a folder eval may write into (new, empty, or an earlier eval's, which
    the run resumes), never one of the inputs; --write-docs is a file and not replaced silently."""
    from ..models.paths import is_bundled, resolve_model_path
    from ..outputs import check_output

    inputs = [resolve_model_path(i) if is_bundled(i) else i for i in inputs]
    out = check_output(args.out, overwrite=True, inputs=inputs, directory=True, replaces=False)
    if out.is_dir() and any(out.iterdir()) and not any((out / name).exists() for name in EVAL_ENTRIES):
        if not args.overwrite:
            raise FileExistsError(f"--out {out} holds files but no earlier evaluation; pass --overwrite to write the "
                                  "evaluation into it anyway, or choose a fresh --out")
    if args.write_docs:
        check_output(args.write_docs, overwrite=args.overwrite, inputs=inputs, flag="--write-docs")


def run_budgets(args, settings, t0: float) -> int:
    from ..eval.budgets import budget_rows, compare_budgets

    if args.plan or args.sweep:
        raise ValueError("--budgets evaluates topk budgets on two models; drop --plan/--sweep")
    result = compare_budgets(settings, args.model, args.original, args.budgets, Path(args.out), args.tolerance,
                             log=lambda m: print(m, file=sys.stderr), overwrite=args.overwrite)
    print_table(f"accuracy per budget: {args.model} vs {args.original} (* usable: split "
                f"{result['usable_points']['split']}, original {result['usable_points']['original']})",
                ["active fraction", "split k", "split acc %", "split p50/p90", "original k", "original acc %",
                 "original p50/p90"], budget_rows(result))
    print(f"wrote {Path(args.out) / 'budgets.md'} (+ .json, .png) in {time.time() - t0:.0f} s")
    return 0


def run_kl(args) -> int:
    """``--metric kl``: held-out KL of a plan or a pruned checkpoint from the full model, layer-streamed."""
    from ..data.corpus import bundled_documents
    from ..device import Placement
    from ..eval.metrics import heldout_windows
    from ..eval.streamed_kl import heldout_kl_streamed
    from ..models import load_tokenizer, resolve_model_path
    from ..models.checkpoint import working_dtype
    from ..outputs import check_output, write_json

    if args.sweep or args.budgets:
        raise ValueError("--metric kl compares one candidate; pass --plan PLAN or --pruned DIR (not --sweep/--budgets)")
    if args.kl_window < 4:
        raise ValueError(f"--kl-window must be at least 4 tokens, got {args.kl_window}")
    path = resolve_model_path(args.model)
    inputs = [path] + ([resolve_model_path(args.pruned)] if args.pruned else []) + ([args.plan] if args.plan else [])
    out = check_output(args.out, overwrite=True, inputs=inputs, directory=True, replaces=False)
    check_output(out / "kl.json", overwrite=args.overwrite, inputs=inputs)
    windows = heldout_windows(load_tokenizer(args.model), bundled_documents("heldout"), args.kl_docs, args.kl_window)
    result = heldout_kl_streamed(path, windows, plan=args.plan, pruned=args.pruned,
                                 dtype=working_dtype(args.dtype, path), placement=Placement.of(args.device))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "kl.json", {"model": str(path), "plan": args.plan, "pruned": args.pruned, "dtype": args.dtype,
                                 "windows": len(windows), "window": args.kl_window, **result.to_json()})
    print_table(f"held-out KL vs the full {args.model} ({len(windows)} windows x {args.kl_window} tokens, layer-streamed)",
                ["candidate", "KL nats/token", "ppl full", "ppl candidate", "tokens", "seconds", "peak RSS GiB"],
                [(result.candidate, f"{result.kl:.4f}", f"{result.perplexity_full:.2f}", f"{result.perplexity:.2f}",
                  result.tokens, f"{result.seconds:.0f}", f"{result.peak_rss_gib:.2f}")])
    print(f"wrote {out / 'kl.json'}")
    return 0
