"""`moetailor search-k MODEL --budget N --out PLAN`: a per-layer active-expert allocation that keeps
next-token KL to the full model low under a total budget (coordinate descent; see eval/search_k.py)."""
from __future__ import annotations

import json

from ..tables import print_table
from .options import add_device_option, add_overwrite_option, invocation


def register(sub) -> None:
    p = sub.add_parser("search-k", help="search a per-layer active-expert allocation under a total budget "
                       "(next-token KL to the full model on calibration text) and write it as a plan")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=int, help="total active experts per token summed over MoE layers")
    budget.add_argument("--mean-k", type=float, help="mean active experts per MoE layer (budget = round(mean * layers))")
    p.add_argument("--out", required=True, help="plan JSON to write")
    add_overwrite_option(p, help="replace --out if it exists")
    p.add_argument("--phase", choices=("both", "decode", "prefill"), default="both",
                   help="phases the allocation applies to (default both)")
    p.add_argument("--data", default=None, help="calibration text spec, as for `moetailor calibrate` (default for "
                   "'reference': tasks, its workload; required otherwise)")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens scored per allocation (default 4096)")
    p.add_argument("--window", type=int, default=128, help="tokens per window; KL is scored on each second half")
    p.add_argument("--max-rounds", type=int, default=20, help="at most this many accepted transfers")
    p.add_argument("--tol", type=float, default=1e-4, help="a transfer must lower KL by more than this (nats)")
    p.add_argument("--heldout-docs", type=int, default=1,
                   help="held-out documents per text domain to check the result on (0 = skip)")
    p.add_argument("--accuracy-n", type=int, default=0,
                   help="also report greedy task accuracy (full, uniform, searched) on N prompts per task")
    p.add_argument("--tasks", default="all", help="tasks for --accuracy-n")
    p.add_argument("--seed", type=int, default=0)
    add_device_option(p)
    p.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    from ..calibration.data import data_file, default_data_spec
    from ..eval.search_k import search_plan
    from ..models import load_model, load_tokenizer
    from ..models.loading import resolve_model_path
    from ..outputs import check_output
    from ..plans.techniques import Shape

    if args.tokens < 1 or args.window < 4:
        raise ValueError("--tokens must be >= 1 and --window >= 4")
    data = default_data_spec(args.model, args.data)   # --data is required beyond the bundled models
    out = check_output(args.out, overwrite=args.overwrite, inputs=(resolve_model_path(args.model), data_file(data)))
    model = load_model(args.model, device=args.device)
    tokenizer = load_tokenizer(args.model)
    shape = Shape.of(model)
    budget = args.budget if args.budget is not None else int(round(args.mean_k * len(shape.layers)))
    command = invocation("search-k")
    plan, summary = search_plan(model, tokenizer, budget, data=data, tokens=args.tokens, window=args.window,
                                phase=args.phase, max_rounds=args.max_rounds, tol=args.tol,
                                heldout_docs=args.heldout_docs, accuracy_n=args.accuracy_n, tasks=args.tasks,
                                seed=args.seed, command=command)
    plan.save(out)
    s = summary["search"]
    rows = [(pos, layer, u, k) for pos, (layer, u, k) in enumerate(zip(shape.layers, s["uniform"], s["ks"]))]
    print_table(f"search-k {args.model}: budget {budget} ({budget / len(shape.layers):.2f} per layer), "
                f"{args.phase} phase(s)", ["MoE layer", "decoder layer", "uniform k", "searched k"], rows)
    quality = [("KL on search text (nats/token)", f"{s['uniform_kl']:.4f}", f"{s['kl']:.4f}")]
    if "heldout" in summary:
        h = summary["heldout"]
        quality.append(("KL on held-out text", f"{h['uniform_kl']:.4f}", f"{h['searched_kl']:.4f}"))
    if "accuracy" in summary:
        a = summary["accuracy"]
        quality.append((f"task accuracy (n={args.accuracy_n}/task; full {100 * a['full']:.1f}%)",
                        f"{100 * a['uniform']:.1f}%", f"{100 * a['searched']:.1f}%"))
    print_table(f"quality ({s['evaluations']} allocations scored, {s['rounds']} transfers, {summary['seconds']:.0f} s)",
                ["measure", "uniform", "searched"], quality)
    print(f"wrote {out}  (evaluate: moetailor eval {args.model} --plan {out} --configs baseline,plan)")
    print(json.dumps({"ks": s["ks"], "kl": s["kl"], "uniform_kl": s["uniform_kl"]}))
    return 0
