"""`moetailor serve MODEL --port N`: the OpenAI-compatible server over the phase-aware engine."""
from __future__ import annotations

import os
from pathlib import Path

from .generate import add_engine_arguments, build_engine

API_KEY_ENV = "MOETAILOR_API_KEY"   # read by `serve` when --api-key is not given
PLANS_NEED_COLOCATED = ("--expert-plan needs a colocated engine (the disaggregated decode worker holds one pruned "
                        "pool); drop --expert-plan or --decode-model")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                       "/v1/models, /health, /metrics)")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the model folder's name)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                        f"{API_KEY_ENV} environment variable; unset = no authentication)")
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="largest request body (413 above it)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="most characters in a text prompt or all chat messages, checked before tokenizing "
                        "(413 above it; default: 32 x the context length)")
    p.add_argument("--max-stop-strings", type=int, default=16, help="most stop strings per request")
    p.add_argument("--max-stop-chars", type=int, default=256, help="longest stop string")
    p.add_argument("--max-messages", type=int, default=4096, help="most chat messages per request (413 above it)")
    p.add_argument("--max-detokenize-ids", type=int, default=None,
                   help="most token ids per /detokenize request (413 above it; default: 32 x the context length)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections; a new one beyond them is answered 503 and closed")
    p.add_argument("--idle-timeout", type=float, default=5.0,
                   help="seconds a connection may send nothing (before a request or after a response)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds from a request's first byte until its request head must be complete")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds from a request's head until its body must be complete (408 after it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish after SIGTERM")
    p.add_argument("--expert-plan", action="append", default=[], metavar="NAME=PATH",
                   help="a plan clients may select per request with the \"expert_plan\" field (repeatable)")
    p.add_argument("--no-guard", action="store_true",
                   help="serve reduced pools as planned even when they collapse (measuring a plan, e.g. with "
                        "lm-eval); by default the collapse guard sends requests back to the full pool")
    p.add_argument("--observe", metavar="STATS", default=None,
                   help="accumulate the served traffic's calibration statistics (the file `moetailor calibrate` "
                        "writes; `moetailor plan --stats` reads it) and write them to STATS at shutdown, on "
                        "POST /observe/save, and every --observe-every steps")
    p.add_argument("--observe-every", type=int, default=0, metavar="N",
                   help="with --observe: also write the statistics every N engine steps (0: at shutdown and on "
                        "demand only)")
    from ..integrations.vllm.options import add_backend_arguments
    add_backend_arguments(p)   # --backend engine|vllm (vLLM: the plugin, colocated or a disaggregated pair)
    p.set_defaults(func=run)


def parse_named_plans(items: list[str], model) -> dict:
    from ..models.loading import load_checked
    from ..plans.plan import Plan

    plans = {}
    if items and model is None:
        raise ValueError(PLANS_NEED_COLOCATED)
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--expert-plan {item!r} must look like NAME=PATH (e.g. half=plans/half.json)")
        if name in ("default", "full") or name in plans:
            raise ValueError(f"--expert-plan name {name!r} is reserved or repeated; choose another name")
        plans[name] = load_checked(path, Plan, model)
    return plans


def show_server_log() -> None:
    """The server's one-line notes (a client that left mid-body, a guard move) go to stderr beside uvicorn's
    access lines, in its format; without a handler Python would print only warnings and errors."""
    import logging

    from uvicorn.logging import DefaultFormatter

    for name in ("moetailor.server", "moetailor.guard"):
        logger = logging.getLogger(name)
        if not any(getattr(h, "_moetailor", False) for h in logger.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
            handler._moetailor = True
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def run(args) -> int:
    from ..serving.server import ServerLimits, serve

    if args.backend == "vllm":
        from ..integrations.vllm.serve import run as run_vllm
        return run_vllm(args)
    for flag, why in (("vllm_experts_kernel", "always runs its own experts kernel"),
                      ("vllm_no_prefix_caching", "switches plans per request and keeps its prefix cache per plan"),
                      ("vllm_novice", "adds novice constants for any plan")):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} is for --backend vllm; moetailor's engine {why}")
    if args.k_schedule == "tiers":
        raise ValueError("--k-schedule tiers plans a known set of requests offline (`moetailor generate`); a server "
                         "sees requests arrive one by one: use --k-schedule lanes")
    limits = ServerLimits(max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                          max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                          max_messages=args.max_messages, max_detokenize_ids=args.max_detokenize_ids,
                          max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
                          header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                          shutdown_timeout_s=args.shutdown_timeout)
    api_key = resolve_api_key(args.api_key, os.environ.get(API_KEY_ENV))
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port; give one from 1 to 65535 (0: any free port)")
    name = served_model_name(args.model, args.served_model_name)
    if args.expert_plan and args.decode_model:   # refused before either worker loads a model
        raise ValueError(PLANS_NEED_COLOCATED)
    if args.observe is not None or args.observe_every:
        check_observe_arguments(args)            # before the model loads
    llm = build_engine(args)
    if args.observe is not None:
        from .calibrate import command_line
        llm.observe(args.observe, args.observe_every, command=command_line(args, positional=("model",)))
    plans = parse_named_plans(args.expert_plan, llm.model)
    show_server_log()
    serve(llm, host=args.host, port=args.port, model_name=name, plans=plans, limits=limits, api_key=api_key,
          guard=not args.no_guard)
    return 0


def check_observe_arguments(args) -> None:
    """--observe's path must be writable and the engine colocated (the disaggregated pair's decode worker
    runs another process's model)."""
    from ..calibration.observe import check_observe_path

    if args.observe is None:
        raise ValueError("--observe-every needs --observe STATS (the statistics file to write)")
    if args.observe_every < 0:
        raise ValueError(f"--observe-every {args.observe_every} must be 0 (at shutdown and on demand only) or a "
                         "positive step count")
    if args.decode_model:
        raise ValueError("--observe needs a colocated engine: drop --decode-model (or observe with the vLLM plugin)")
    check_observe_path(args.observe)


def served_model_name(model: str, given: str | None) -> str:
    """The id clients see: --served-model-name, else the model folder's name (never its path)."""
    if given is not None:
        if not given.strip():
            raise ValueError("--served-model-name must not be empty")
        return given
    from ..models.paths import is_bundled

    return str(model) if is_bundled(model) else Path(model).resolve().name


def resolve_api_key(flag: str | None, env: str | None) -> str | None:
    """The key clients must send: --api-key, else MOETAILOR_API_KEY, else None (no authentication).
    An empty or blank key is refused: it would silently turn authentication off."""
    for value, source in ((flag, "--api-key"), (env, f"the {API_KEY_ENV} environment variable")):
        if value is None:
            continue
        if not value.strip():
            raise ValueError(f"{source} is empty, which would turn authentication off; give a non-empty key, or "
                             f"leave out --api-key and unset {API_KEY_ENV} to serve without one")
        if value != value.strip() or any(not c.isprintable() for c in value):
            raise ValueError(f"{source} has spaces at its ends or control characters; clients cannot send those "
                             "in an Authorization header reliably: use a printable key without them")
        return value
    return None
