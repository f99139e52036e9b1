"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

One engine thread runs steps while requests are unfinished; HTTP handlers submit requests and read
per-request asyncio queues fed from that thread. Extension fields (beyond the OpenAI schema):
``expert_plan`` (name of a plan loaded at start-up with ``--plan NAME=PATH``; "default" = the
engine's own plan, "full" = the full router) and ``expert_top_k`` (active experts per token).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .llm import LLM, StreamDelta
from .sequence import delta as stream_delta
from .sampling import SamplingParams


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_text: int = 0
    sent_tokens: int = 0


class AsyncEngine:
    """Drives ``llm.step()`` in a background thread and delivers each request's deltas."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.requests: dict[str, _Request] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.started = time.time()
        self.thread = threading.Thread(target=self._run, name="moetailor-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt, sampling: SamplingParams, plan=None, plan_key: str | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a request (ValueError for one that can never run); returns its id and delta queue."""
        request_id = uuid.uuid4().hex
        entry = _Request(asyncio.get_running_loop(), asyncio.Queue())
        self.requests[request_id] = entry
        try:
            self.llm.add_request(prompt, sampling, request_id=request_id, plan=plan, plan_key=plan_key)
        except Exception:
            self.requests.pop(request_id, None)
            raise
        self.wake.set()
        return request_id, entry.queue

    def abort(self, request_id: str) -> None:
        if self.llm.abort(request_id):
            self._deliver_final(request_id)

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=5)
        close = getattr(self.llm, "close", None)
        if close:
            close()

    def _run(self) -> None:
        while not self.stopping:
            if not self.llm.has_unfinished():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                seqs = self.llm.step()
            except Exception as e:  # a failing step ends its requests with an error; the server keeps going
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            for seq in seqs:
                self._deliver(seq)

    def _deliver(self, seq) -> None:
        entry = self.requests.get(seq.request_id)
        if entry is None:
            return
        delta = stream_delta(seq, entry.sent_text, entry.sent_tokens)
        entry.sent_text, entry.sent_tokens = entry.sent_text + len(delta.text), entry.sent_tokens + len(delta.token_ids)
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
        entry.loop.call_soon_threadsafe(entry.queue.put_nowait, delta)

    def _deliver_final(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            entry.loop.call_soon_threadsafe(entry.queue.put_nowait,
                                            StreamDelta(request_id, "", [], True, "abort", None))

    def _fail_all(self, error: str) -> None:
        with self.llm.lock:
            for request_id in list(self.requests):
                self.llm.abort(request_id, reason="error", error=error)
                entry = self.requests.pop(request_id, None)
                if entry is not None:
                    entry.loop.call_soon_threadsafe(entry.queue.put_nowait,
                                                    StreamDelta(request_id, "", [], True, "error", error))


class BadRequest(ValueError):
    pass


def _sampling_from(body: dict) -> SamplingParams:
    """SamplingParams from an OpenAI request body; BadRequest names the field."""
    def number(name, default, kind=float):
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        return kind(value)
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings")
    if body.get("n", 1) not in (1, None):
        raise BadRequest("n must be 1 (one completion per request)")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    try:
        return SamplingParams(max_tokens=number(field, 16, int),
                              temperature=number("temperature", 1.0), top_p=number("top_p", 1.0),
                              top_k=number("top_k", 0, int), seed=number("seed", None, int), stop=tuple(stop),
                              ignore_eos=bool(body.get("ignore_eos", False)),
                              expert_top_k=number("expert_top_k", None, int))
    except ValueError as e:
        raise BadRequest(str(e)) from None


def create_app(llm: LLM, model_name: str = "moetailor", plans: dict | None = None, guard: bool = True):
    """The FastAPI app. ``plans``: name -> Plan selectable per request through ``expert_plan``.
    ``guard``: turn on the collapse guard (engine/guard.py) when the engine has none yet."""
    from ..plans.plan import uniform_plan

    plans = dict(plans or {})
    if getattr(llm, "model", None) is not None:
        plans.setdefault("full", uniform_plan(llm.model))
        for plan in plans.values():
            plan.check_model(llm.model)
    elif plans:
        raise ValueError("per-request expert plans need a colocated engine (the disaggregated decode worker "
                         "holds one pruned pool); drop --expert-plan or --decode-model")
    if guard and getattr(llm, "model", None) is not None and getattr(llm, "guard", False) is None:
        llm.enable_guard()
    engine = AsyncEngine(llm)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="moetailor", lifespan=lifespan)
    app.state.engine = engine

    def error(status: int, message: str, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    def resolve_plan(body: dict):
        name = body.get("expert_plan")
        if name is None or name == "default":
            return None, None
        if not isinstance(name, str) or name not in plans:
            raise BadRequest(f"unknown expert_plan {name!r}; this server has: default, {', '.join(sorted(plans))} "
                             "(load more with --plan NAME=PATH)")
        return plans[name], name

    async def read_body(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise BadRequest(f"unknown model {body.get('model')!r}; this server serves {model_name!r}")
        return body

    async def run(request: Request, chat: bool):
        try:
            body = await read_body(request)
            sampling = _sampling_from(body)
            plan, plan_key = resolve_plan(body)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(
                        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                    raise BadRequest("messages must be a non-empty list of {role, content} objects with string content")
                prompt = _chat_prompt(llm.tokenizer, messages)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                                    and all(isinstance(t, int) for t in prompt))):
                    raise BadRequest("prompt must be a string or a list of token ids")
            request_id, queue = engine.submit(prompt, sampling, plan, plan_key)
        except ValueError as e:
            return error(400, str(e))
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        oid = ("chatcmpl-" if chat else "cmpl-") + request_id

        def choice(delta: StreamDelta, text: str, streaming: bool) -> dict:
            reason = delta.finish_reason if delta.finished else None
            if chat:
                key = "delta" if streaming else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if body.get("stream"):
            async def events():
                finished = False
                try:
                    while True:
                        delta: StreamDelta = await queue.get()
                        if delta.error:
                            yield f"data: {json.dumps({'error': {'message': delta.error, 'type': 'engine_error'}})}\n\n"
                        chunk = {"id": oid, "object": kind + (".chunk" if chat else ""), "created": created,
                                 "model": model_name, "choices": [choice(delta, delta.text, True)]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        if delta.finished:
                            finished = True
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    if not finished:   # client went away: free the request's KV blocks
                        engine.abort(request_id)
            return StreamingResponse(events(), media_type="text/event-stream")

        text, tokens, last = [], [], None
        try:
            while True:
                try:
                    delta = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.abort(request_id)
                        return error(499, "client disconnected")
                    continue
                text.append(delta.text)
                tokens += delta.token_ids
                last = delta
                if delta.finished:
                    break
        except asyncio.CancelledError:
            engine.abort(request_id)
            raise
        if last.finish_reason == "error":
            return error(500, f"generation failed: {last.error}", "engine_error")
        prompt_tokens = len(llm.encode(prompt)[1])
        return {"id": oid, "object": kind, "created": created, "model": model_name,
                "choices": [choice(last, "".join(text), False)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                          "total_tokens": prompt_tokens + len(tokens)}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(engine.started),
                                            "owned_by": "moetailor", "max_model_len": llm.max_model_len,
                                            "expert_plans": ["default", *sorted(plans)]}]}

    @app.get("/health")
    async def health():
        alive = engine.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine thread stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(llm), media_type="text/plain; version=0.0.4")

    return app


def prometheus_text(llm: LLM) -> str:
    s = llm.stats()
    lines = []

    def metric(name, kind, help_, value, labels=""):
        lines.extend([f"# HELP moetailor_{name} {help_}", f"# TYPE moetailor_{name} {kind}",
                      f"moetailor_{name}{labels} {value}"])
    metric("requests_waiting", "gauge", "Requests queued for prefill.", s["waiting"])
    metric("requests_running", "gauge", "Requests holding KV blocks.", s["running"])
    metric("kv_blocks_total", "gauge", "KV blocks in the pool.", s["kv_blocks_total"])
    metric("kv_cache_usage", "gauge", "Fraction of KV blocks in use.", f"{s['kv_usage']:.4f}")
    metric("preemptions_total", "counter", "Sequences preempted for recompute.", s["preemptions"])
    metric("generated_tokens_total", "counter", "Tokens generated.", s["tokens_generated"])
    metric("decode_tokens_per_second", "gauge", "Decode throughput over recent steps.", f"{s['decode_tokens_per_s']:.2f}")
    last = llm.step_log[-1] if llm.step_log else None
    lines += ["# HELP moetailor_step_distinct_experts Distinct experts read per MoE layer in the last step.",
              "# TYPE moetailor_step_distinct_experts gauge"]
    if last is not None:
        for layer, n in sorted(last.distinct_experts.items()):
            lines.append(f'moetailor_step_distinct_experts{{layer="{layer}",phase="{last.phase}"}} {n}')
    metric("step_expert_bytes", "gauge", "Expert weight bytes read in the last step.", last.expert_bytes if last else 0)
    guard = getattr(llm, "guard", None)
    if guard is not None and guard.enabled:
        lines.extend(guard_metrics(guard.snapshot()))
    return "\n".join(lines) + "\n"


def guard_metrics(snap: dict) -> list[str]:
    """The collapse guard's state per expert policy, in Prometheus text format."""
    from .guard import STATES

    families = {
        "guard_policy_state": ("gauge", "Guard state per policy: 0 active, 1 probation, 2 tripped (full pool)."),
        "guard_trips_total": ("counter", "Times the guard switched a policy to the full pool."),
        "guard_decode_steps_total": ("counter", "Decode steps of guarded requests by pool: reduced, fallback "
                                                "(sent back to the full pool) or shadow (full-pool comparison)."),
        "guard_rescued_requests_total": ("counter", "Running requests moved to the full pool, by reason."),
        "guard_window_budget_hit_share": ("gauge", "Share of recent requests that hit max_tokens."),
        "guard_window_p90_tokens": ("gauge", "p90 output length of recent requests."),
        "guard_window_entropy_nats": ("gauge", "Mean next-token entropy of recent requests."),
    }
    samples: dict[str, list[str]] = {name: [] for name in families}

    def window(policy: str, w: dict) -> None:
        for name, key in (("guard_window_budget_hit_share", "budget_hit_share"), ("guard_window_p90_tokens", "p90"),
                          ("guard_window_entropy_nats", "entropy")):
            if w["requests"]:
                samples[name].append(f'moetailor_{name}{{policy="{policy}"}} {w[key]:.4f}')

    window("full", snap["reference"])
    for policy, p in snap["policies"].items():
        label = f'policy="{policy}"'
        samples["guard_policy_state"].append(f"moetailor_guard_policy_state{{{label}}} {STATES.index(p['state'])}")
        samples["guard_trips_total"].append(f"moetailor_guard_trips_total{{{label}}} {p['trips']}")
        for pool, n in p["decode_steps"].items():
            samples["guard_decode_steps_total"].append(f'moetailor_guard_decode_steps_total{{{label},pool="{pool}"}} {n}')
        for reason, n in p["rescued"].items():
            samples["guard_rescued_requests_total"].append(
                f'moetailor_guard_rescued_requests_total{{{label},reason="{reason}"}} {n}')
        window(policy, p["window"])
    lines = []
    for name, (kind, help_) in families.items():
        lines += [f"# HELP moetailor_{name} {help_}", f"# TYPE moetailor_{name} {kind}", *samples[name]]
    return lines


def _chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The tokenizer's chat template when it has one, else plain "role: content" lines."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, model_name: str = "moetailor",
          plans: dict | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(llm, model_name, plans), host=host, port=port, log_level="info")
