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
from dataclasses import dataclass, replace

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..models.chat import chat_prompt
from .llm import LLM, StreamDelta, new_logprobs
from .logprobs import MAX_LOGPROBS, chat_logprobs, completion_logprobs
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
        text = seq.text
        if not seq.is_finished and text.endswith("\ufffd"):
            text = text[:-1]
        tokens = seq.completion_token_ids
        delta = StreamDelta(seq.request_id, text[entry.sent_text:], tokens[entry.sent_tokens:], seq.is_finished,
                            seq.finish_reason, seq.error, new_logprobs(seq, entry.sent_tokens, len(tokens)),
                            seq.prompt_logprobs if entry.sent_tokens == 0 else None)
        entry.sent_text, entry.sent_tokens = len(text), len(tokens)
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


@dataclass(frozen=True)
class LogprobRequest:
    """What a request asked for beside the tokens: logprobs with the top N alternatives per token,
    and (completions) the prompt echoed back before the completion, with its logprobs."""
    top: int | None = None      # None = no logprobs
    echo: bool = False
    generate: bool = True       # False for echo with max_tokens 0: the prompt is scored, nothing generated


def _logprob_request(body: dict, chat: bool) -> LogprobRequest:
    """The ``logprobs`` / ``top_logprobs`` / ``echo`` fields, type-checked; BadRequest names the field."""
    def top_n(name: str, value) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise BadRequest(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (alternatives per token), "
                             f"got {value!r}")
        return value
    if chat:
        wanted, top = body.get("logprobs"), top_n("top_logprobs", body.get("top_logprobs"))
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest(f"logprobs must be true or false in chat completions (top_logprobs sets how many "
                             f"alternatives), got {wanted!r}")
        if top is not None and not wanted:
            raise BadRequest("top_logprobs needs logprobs: true")
        return LogprobRequest(top=(top or 0) if wanted else None)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, got {echo!r}")
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    no_tokens = type(limit) is int and limit == 0
    if no_tokens and not echo:
        raise BadRequest("max_tokens must be at least 1 (0 is allowed with echo: true, which scores the prompt)")
    return LogprobRequest(top=top_n("logprobs", body.get("logprobs")), echo=bool(echo),
                          generate=not (echo and no_tokens))


@dataclass
class _Collected:
    """What one request returned over its deltas: text, tokens and (when asked) logprobs."""
    text: str
    token_ids: list[int]
    logprobs: list
    prompt_logprobs: list | None
    finish_reason: str | None
    error: str | None

    @classmethod
    def of(cls, deltas: list[StreamDelta]) -> "_Collected":
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        last = deltas[-1]
        return cls("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                   [e for d in deltas for e in (d.logprobs or [])], prompt,
                   last.finish_reason if last.finished else None, last.error)


def _completion_prompts(body: dict) -> list:
    """The completions ``prompt``: a string, a list of token ids, or a list of those (one choice each)."""
    def one(p) -> bool:
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and
                                      all(isinstance(t, int) and not isinstance(t, bool) for t in p))
    prompt = body.get("prompt")
    if one(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of strings or token-id lists "
                     "(one choice each)")


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
        submitted: list[str] = []
        try:
            body = await read_body(request)
            extra = _logprob_request(body, chat)
            # echo with max_tokens 0 scores the prompt: one token is generated (and dropped) to run the prefill
            one_token = {**body, "max_tokens": 1, "max_completion_tokens": None}
            sampling = _sampling_from(body if extra.generate else one_token)
            if (extra.top is not None or extra.echo) and llm.tokenizer is None:
                raise BadRequest("logprobs and echo need the model's tokenizer to return token text; serve a "
                                 "checkpoint directory that has tokenizer files")
            if extra.top is not None:
                sampling = replace(sampling, logprobs=extra.top, prompt_logprobs=extra.top if extra.echo else None)
            plan, plan_key = resolve_plan(body)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(
                        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                    raise BadRequest("messages must be a non-empty list of {role, content} objects with string content")
                prompts = [chat_prompt(llm.tokenizer, messages)]
            else:
                prompts = _completion_prompts(body)
            if body.get("stream") and len(prompts) > 1:
                raise BadRequest("stream returns one prompt's completion; send one prompt, or a list with "
                                 "stream: false")
            encoded = [llm.encode(p) for p in prompts]                   # (text or None, token ids)
            if extra.echo:
                encoded = [(text if text is not None else llm.tokenizer.decode(ids), ids) for text, ids in encoded]
            queues = []
            for prompt in prompts:
                request_id, queue = engine.submit(prompt, sampling, plan, plan_key)
                submitted.append(request_id)
                queues.append(queue)
        except ValueError as e:
            for request_id in submitted:
                engine.abort(request_id)
            return error(400, str(e))
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        oid = ("chatcmpl-" if chat else "cmpl-") + submitted[0]

        def decode(ids: list[int]) -> str:
            return llm.tokenizer.decode(ids)

        def choice(index: int, out: _Collected, streaming: bool, echoed: bool = False, offset: int = 0) -> dict:
            """One choice from what a request produced; ``echoed``: its prompt was already returned
            (streaming), ``offset``: characters already returned (text_offset)."""
            reason = out.finish_reason
            text, token_ids, entries = out.text, out.token_ids, out.logprobs
            if not extra.generate:   # echo with max_tokens 0: only the prompt comes back
                text, token_ids, entries, reason = "", [], [], "length" if reason is not None else None
            if chat:
                key = "delta" if streaming else "message"
                result = {"index": index, key: {"role": "assistant", "content": text}, "finish_reason": reason}
                if extra.top is not None:
                    result["logprobs"] = chat_logprobs(entries, decode)
                return result
            if extra.echo and not echoed:
                prompt_text, prompt_ids = encoded[index]
                text, token_ids = prompt_text + text, prompt_ids + token_ids
                entries = [*(out.prompt_logprobs or [None] * len(prompt_ids)), *entries]
            logprobs = completion_logprobs(entries, token_ids, decode, offset) if extra.top is not None else None
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        if body.get("stream"):
            request_id, queue = submitted[0], queues[0]

            async def events():
                finished, returned, echoed = False, 0, False
                try:
                    while True:
                        delta: StreamDelta = await queue.get()
                        if delta.error:
                            yield f"data: {json.dumps({'error': {'message': delta.error, 'type': 'engine_error'}})}\n\n"
                        part = _Collected.of([delta])
                        c = choice(0, part, True, echoed=echoed, offset=returned)
                        echoed, returned = True, returned + len(c.get("text", ""))
                        chunk = {"id": oid, "object": kind + (".chunk" if chat else ""), "created": created,
                                 "model": model_name, "choices": [c]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        if delta.finished:
                            finished = True
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    if not finished:   # client went away: free the request's KV blocks
                        engine.abort(request_id)
            return StreamingResponse(events(), media_type="text/event-stream")

        outputs = []
        try:
            for request_id, queue in zip(submitted, queues):
                deltas = []
                while not deltas or not deltas[-1].finished:
                    try:
                        deltas.append(await asyncio.wait_for(queue.get(), timeout=1.0))
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            for rid in submitted:
                                engine.abort(rid)
                            return error(499, "client disconnected")
                outputs.append(_Collected.of(deltas))
        except asyncio.CancelledError:
            for rid in submitted:
                engine.abort(rid)
            raise
        failed = next((o for o in outputs if o.finish_reason == "error"), None)
        if failed is not None:
            for rid in submitted:
                engine.abort(rid)
            return error(500, f"generation failed: {failed.error}", "engine_error")
        prompt_tokens = sum(len(ids) for _, ids in encoded)
        completion_tokens = sum(len(o.token_ids) for o in outputs) if extra.generate else 0
        return {"id": oid, "object": kind, "created": created, "model": model_name,
                "choices": [choice(i, o, False) for i, o in enumerate(outputs)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

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

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await read_body(request)
            tok = tokenizer()
            prompt, special = body.get("prompt"), body.get("add_special_tokens", False)
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string")
            if not isinstance(special, bool):
                raise BadRequest(f"add_special_tokens must be true or false, got {special!r}")
        except ValueError as e:
            return error(400, str(e))
        tokens = list(tok.encode(prompt, add_special_tokens=special))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await read_body(request)
            tok = tokenizer()
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadRequest("tokens must be a list of token ids")
        except ValueError as e:
            return error(400, str(e))
        return {"prompt": tok.decode(tokens)}

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




def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, model_name: str = "moetailor",
          plans: dict | None = None, guard: bool = True) -> None:
    import uvicorn

    uvicorn.run(create_app(llm, model_name, plans, guard=guard), host=host, port=port, log_level="info")
