"""`moetailor serve MODEL --port N`: the OpenAI-compatible server over the phase-aware engine."""
from __future__ import annotations

from .generate import add_engine_arguments, build_engine


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                       "/v1/models, /health, /metrics)")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    p.add_argument("--expert-plan", action="append", default=[], metavar="NAME=PATH",
                   help="a plan clients may select per request with the \"expert_plan\" field (repeatable)")
    p.add_argument("--no-guard", action="store_true",
                   help="serve reduced pools as planned even when they collapse (measuring a plan, e.g. with "
                        "lm-eval); by default the collapse guard sends requests back to the full pool")
    p.set_defaults(func=run)


def parse_named_plans(items: list[str], model) -> dict:
    from ..plans.plan import Plan

    plans = {}
    if items and model is None:
        raise ValueError("--expert-plan needs a colocated engine (the disaggregated decode worker holds one pruned "
                         "pool); drop --expert-plan or --decode-model")
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--expert-plan {item!r} must look like NAME=PATH (e.g. half=plans/half.json)")
        if name in ("default", "full") or name in plans:
            raise ValueError(f"--expert-plan name {name!r} is reserved or repeated; choose another name")
        plans[name] = Plan.load(path)
        plans[name].check_model(model)
    return plans


def run(args) -> int:
    from ..engine.server import serve

    if args.k_schedule == "tiers":
        raise ValueError("--k-schedule tiers plans a known set of requests offline (`moetailor generate`); a server "
                         "sees requests arrive one by one: use --k-schedule lanes")
    llm = build_engine(args)
    plans = parse_named_plans(args.expert_plan, llm.model)
    serve(llm, host=args.host, port=args.port, model_name=args.served_model_name or str(args.model), plans=plans,
          guard=not args.no_guard)
    return 0
