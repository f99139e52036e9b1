"""The FastAPI app: its routes, each a few lines over the request parser (``requests``), the engine
thread (``loop``) and the responses (``responses``), and ``serve``."""
from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..client import EngineClient
from ..logprobs import TokenText
from .auth import ApiKeyMiddleware, check_api_key
from .connections import raise_fd_limit, server_config
from .limits import ServerLimits
from .loop import AsyncEngine
from .methods import MethodsMiddleware
from .metrics import prometheus_text
from .requests import (
    BadRequest,
    ClientGone,
    completion_request,
    default_budget,
    detokenize_request,
    fit_budget,
    prompt_from,
    read_body,
    resolve_plan,
    show,
    tokenize_request,
)
from .responses import Reply, collect, error, refusal, stream

log = logging.getLogger("moetailor.server")


def create_app(llm: EngineClient, model_name: str = "moetailor", plans: dict | None = None, guard: bool = True,
               limits: ServerLimits | None = None, api_key: str | None = None):
    """The FastAPI app. ``plans``: name -> Plan selectable per request through ``expert_plan``.
    ``guard``: turn on the collapse guard (serving/guard.py) when the engine has none yet.
    ``limits``: request size bounds. ``api_key``: required as a Bearer token on every path but /health."""
    from ...plans.plan import uniform_plan
    from ..disagg import WorkerUnavailable

    limits = limits or ServerLimits()
    max_prompt_chars = limits.max_prompt_chars or 32 * llm.max_model_len
    plans = dict(plans or {})
    if llm.model is not None:
        plans.setdefault("full", uniform_plan(llm.model))
        for plan in plans.values():
            plan.check_model(llm.model)
    elif plans:
        raise ValueError("per-request expert plans need a colocated engine (the disaggregated decode worker "
                         "holds one pruned pool); drop --expert-plan or --decode-model")
    if api_key is not None:   # an empty key is refused, never read as "no authentication"
        check_api_key(api_key)
    if guard and llm.model is not None and llm.guard is None:
        llm.enable_guard()
    engine = AsyncEngine(llm)
    token_text = TokenText(llm.tokenizer) if llm.tokenizer is not None else None   # logprobs' token text and bytes

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="moetailor", lifespan=lifespan)
    app.state.engine = engine
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MethodsMiddleware, router=app.router)   # outermost: OPTIONS needs no key

    async def run(request: Request, chat: bool):
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            body = await read_body(request, limits, model_name)
            sampling, extra = completion_request(body, chat, limits, llm.tokenizer is not None)
            plan, plan_key = resolve_plan(body, plans, colocated=llm.model is not None)
            prompt = await asyncio.to_thread(prompt_from, body, llm.tokenizer, chat, max_prompt_chars,
                                             limits.max_messages)
            budget = default_budget(body, chat)
            echo_text, echo_ids = await asyncio.to_thread(llm.encode, prompt) if extra.echo or budget else (None, [])
            if budget or not extra.generate:
                sampling = fit_budget(sampling, extra, len(echo_ids), llm.request_limits())
            if extra.echo and echo_text is None:
                echo_text = llm.tokenizer.decode(echo_ids)
            echo_text, echo_ids = (echo_text, echo_ids) if extra.echo else (None, [])
            request_id, queue, prompt_tokens = await asyncio.to_thread(
                engine.submit, asyncio.get_running_loop(), prompt, sampling, plan, plan_key)
        except BadRequest as e:
            return refusal(e)
        except ValueError as e:
            return error(400, str(e))
        except ClientGone as e:
            log.info("request %s: %s", oid, e)
            return error(499, "client disconnected")
        except WorkerUnavailable as e:
            return error(503, f"{e}; see /health", "server_unavailable")
        except Exception:
            log.exception("request %s failed before it reached the engine", oid)
            return error(500, f"internal error for request {oid}; the server log has the details", "server_error")
        reply = Reply(("chatcmpl-" if chat else "cmpl-") + request_id, chat, model_name, extra, prompt_tokens,
                      token_text, sampling.stop, echo_text, echo_ids)
        if body.get("stream"):
            return stream(reply, queue, engine, request_id,
                          with_usage=bool((body.get("stream_options") or {}).get("include_usage")))
        return await collect(reply, queue, engine, request_id, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(engine.started), "owned_by": "moetailor",
                "max_model_len": llm.max_model_len, "expert_plans": ["default", *sorted(plans)]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error(404, f"unknown model {show(model_id)}; this server serves {model_name!r}",
                         code="model_not_found")
        return model_card()

    # vLLM's tokenizer endpoints: clients such as lm-evaluation-harness tokenize with the server's own tokenizer
    def tokenizer() -> object:
        if llm.tokenizer is None:
            raise BadRequest("this server has no tokenizer (it was started on a checkpoint without tokenizer files)")
        return llm.tokenizer

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        try:
            tok = tokenizer()
        except BadRequest as e:
            return error(400, str(e))
        info = {name: getattr(tok, name, None) for name in ("eos_token", "bos_token", "pad_token", "chat_template")}
        return {"tokenizer_class": type(tok).__name__, **info, "model_max_length": llm.max_model_len}

    max_ids = limits.max_detokenize_ids or 32 * llm.max_model_len

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """Size-checked like a prompt, encoded off the event loop (7.5 MB blocked /health for 6 s)."""
        try:
            body = await read_body(request, limits, model_name)
            tok = tokenizer()
            prompt, special = tokenize_request(body, max_prompt_chars)
        except BadRequest as e:
            return refusal(e)
        except ClientGone as e:
            log.info("%s: %s", request.url.path, e)
            return error(499, "client disconnected")
        tokens = list(await asyncio.to_thread(tok.encode, prompt, add_special_tokens=special))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """Decoded off the event loop."""
        try:
            body = await read_body(request, limits, model_name)
            tok = tokenizer()
            tokens = detokenize_request(body, max_ids, len(tok))
        except BadRequest as e:
            return refusal(e)
        except ClientGone as e:
            log.info("%s: %s", request.url.path, e)
            return error(499, "client disconnected")
        return {"prompt": await asyncio.to_thread(tok.decode, tokens)}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        """200 and "ok" when the engine thread and every worker are up; 503 otherwise, saying which is not."""
        body, ok = {"status": "ok"}, engine.thread.is_alive()
        if not ok:
            body["status"] = "engine thread stopped"
        info = llm.health()
        if info["workers"]:
            body["workers"] = info["workers"]
            if ok and not info["ok"]:
                ok, body["status"] = False, "degraded: " + ", ".join(
                    f"{kind} worker {w['state']}" for kind, w in info["workers"].items() if w["state"] != "ready")
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/observe/save")
    async def observe_save():
        """Write the observed statistics now (``--observe``): 200 with the path, tokens and steps counted."""
        observer = llm.observer
        if observer is None:
            return error(404, "this server does not observe its traffic; start it with --observe STATS")
        meta = await asyncio.to_thread(observer.save)
        return {"path": str(observer.path), "tokens": meta["tokens"], "steps": meta["observed"]["steps"]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(llm), media_type="text/plain; version=0.0.4")

    return app


def serve(llm: EngineClient, host: str = "127.0.0.1", port: int = 8000, model_name: str = "moetailor",
          plans: dict | None = None, limits: ServerLimits | None = None, api_key: str | None = None,
          guard: bool = True) -> None:
    import uvicorn

    limits = limits or ServerLimits()
    raise_fd_limit(limits)
    app = create_app(llm, model_name, plans, guard=guard, limits=limits, api_key=api_key)
    uvicorn.Server(server_config(app, host, port, limits)).run()
