"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

One engine thread runs steps while requests are unfinished; HTTP handlers submit requests and read
per-request asyncio queues fed from that thread. Extension fields (beyond the OpenAI schema):
``expert_plan`` (name of a plan loaded at start-up with ``--expert-plan NAME=PATH``; "default" =
the engine's own plan, "full" = the full router) and ``expert_top_k`` (active experts per token).

Every request is checked once, before an engine sees it: each field's type and range (a float must
be finite), the body size, the prompt's characters before tokenizing, the stop strings; a field the
server does not implement is a 400 that says so. A request that fails inside the engine ends alone
with a short message and its request id (the traceback goes to the log).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..models.chat import chat_prompt
from .client import EngineClient
from .sequence import StreamDelta
from .logprobs import MAX_LOGPROBS, chat_logprobs, completion_logprobs
from .sequence import delta as stream_delta
from .sampling import SamplingParams

log = logging.getLogger("moetailor.server")

@dataclass
class ServerLimits:
    """What one request may ask for (``moetailor serve`` flags of the same names)."""
    max_request_bytes: int = 8 * 2**20     # the HTTP body
    max_prompt_chars: int | None = None    # characters of a text prompt (chat: all messages), checked before
                                           # tokenizing; None = 32 x the context length in tokens
    max_stop_strings: int = 16
    max_stop_chars: int = 256              # per stop string
    max_messages: int = 4096               # chat messages per request
    max_detokenize_ids: int | None = None  # token ids per /detokenize request; None = 32 x the context length
    max_connections: int = 1024            # open HTTP connections; more are answered 503 and closed
    idle_timeout_s: float = 5.0            # a connection that sends nothing for this long is closed
    header_timeout_s: float = 10.0         # ... and one whose request head is not complete by then
    shutdown_timeout_s: float = 30.0       # SIGTERM: requests in flight get this long to finish

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_chars", "max_stop_strings", "max_stop_chars", "max_messages",
                     "max_detokenize_ids", "max_connections"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} {value!r} must be an integer >= 1")
        for name in ("idle_timeout_s", "header_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} {value!r} must be a positive number "
                                 "of seconds")


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_text: int = 0
    sent_tokens: int = 0


class AsyncEngine:
    """Drives ``llm.step()`` in a background thread and delivers each request's deltas."""

    def __init__(self, llm: EngineClient):
        self.llm = llm
        self.requests: dict[str, _Request] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.started = time.time()
        self.thread = threading.Thread(target=self._run, name="moetailor-engine", daemon=True)
        self.thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, prompt, sampling: SamplingParams, plan=None,
               plan_key: str | None = None) -> tuple[str, asyncio.Queue, int]:
        """Queue a request (ValueError for one that can never run); returns its id, delta queue and
        prompt tokens. Tokenizes, so the server calls it off the event loop."""
        request_id = uuid.uuid4().hex
        entry = _Request(loop, asyncio.Queue())
        self.requests[request_id] = entry
        try:
            seq = self.llm.add_request(prompt, sampling, request_id=request_id, plan=plan, plan_key=plan_key)
        except Exception:
            self.requests.pop(request_id, None)
            raise
        self.wake.set()
        return request_id, entry.queue, seq.num_prompt_tokens

    def abort(self, request_id: str) -> None:
        if self.llm.abort(request_id):
            self._deliver_final(request_id)

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=5)
        self.llm.close()

    def _run(self) -> None:
        while not self.stopping:
            try:
                if not self.llm.has_unfinished():
                    seqs = self.llm.poll()   # a disaggregated front end watches its workers while idle too
                    if not seqs:
                        self.wake.wait(0.05)
                        self.wake.clear()
                        continue
                else:
                    seqs = self.llm.step()   # a request that fails in it comes back finished with an error
            except Exception as e:           # a bug outside any one request: end what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"internal error ({type(e).__name__}) in the engine; the server log has the details")
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


class TooLarge(BadRequest):
    pass


# OpenAI fields the server accepts and ignores (bookkeeping for the client), and fields it leaves
# to the code that implements them (log probabilities, echo).
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
PASSED_FIELDS = {"logprobs", "top_logprobs", "echo"}
SAMPLING_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "top_k", "seed", "stop", "stream", "stream_options", "ignore_eos", "expert_top_k", "expert_plan",
                   "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "suffix", "tools", "tool_choice", "functions", "function_call", "response_format"}
ROLES = ("system", "developer", "user", "assistant", "tool")


def _show(value) -> str:
    """A client's value in a message, short."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)} items"
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (ValueError, RecursionError):   # deeply nested
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _not_implemented(name: str, value) -> BadRequest:
    return BadRequest(f"{name}={_show(value)} is not implemented by this server; leave it out "
                      "(or at its default)")


def _check_unimplemented(body: dict) -> None:
    """A field the server does not implement is a 400 that says so (a silent 200 would mislead an
    evaluation harness); each at its neutral value is accepted."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None:
            _integer(body, name)
            if value != 1:
                raise _not_implemented(name, value)
    for name, neutral, low, high in (("presence_penalty", 0.0, -2.0, 2.0), ("frequency_penalty", 0.0, -2.0, 2.0),
                                     ("repetition_penalty", 1.0, 0.0, 100.0)):
        value = _number(body, name)
        if value is None:
            continue
        if not low <= value <= high:
            raise BadRequest(f"{name}={value!r} must be in [{low:g}, {high:g}]")
        if value != neutral:
            raise _not_implemented(name, value)
    for name in ("logit_bias", "suffix", "tools", "tool_choice", "functions", "function_call"):
        if body.get(name) not in (None, {}, [], "", "none"):
            raise _not_implemented(name, body[name])
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _not_implemented("response_format", fmt)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object")
        unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise BadRequest(f"unknown field stream_options.{unknown[0]}: this server does not implement it")
        for key in ("include_usage", "continuous_usage_stats"):
            _boolean(options, key)   # (the field name in the message is the key's)
        if options.get("continuous_usage_stats"):
            raise _not_implemented("stream_options.continuous_usage_stats", True)
        if options and body.get("stream") is not True:
            raise BadRequest("stream_options is only allowed with stream: true")
    unknown = sorted(set(body) - SAMPLING_FIELDS - IGNORED_FIELDS - PASSED_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: this server does not implement it; leave it out")


def _number(body: dict, name: str, default=None):
    """A finite JSON number (not a boolean) or ``default`` when absent/null; BadRequest names the field."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {_show(value)}")
    return float(value)


def _integer(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)   # 16.0 from some clients
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {_show(value)}")
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {_show(value)}")
    return value


def _sampling_from(body: dict, limits: ServerLimits | None = None) -> SamplingParams:
    """SamplingParams from an OpenAI request body; BadRequest names the field and the limit."""
    limits = limits or ServerLimits()
    _check_unimplemented(body)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > limits.max_stop_strings:
        raise BadRequest(f"stop has {len(stop)} strings; this server allows at most {limits.max_stop_strings} "
                         "(--max-stop-strings)")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise BadRequest(f"a stop string is longer than {limits.max_stop_chars} characters (--max-stop-chars)")
    for i, s in enumerate(stop):
        _check_text(s, f"stop[{i}]")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    seed = _integer(body, "seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise BadRequest(f"seed must be an integer in [0, 2**63 - 1], got {seed}")
    _boolean(body, "stream")
    top_k = _integer(body, "top_k", 0)
    if top_k == -1:   # vLLM's and many clients' spelling of "off"
        top_k = 0
    try:
        return SamplingParams(max_tokens=_integer(body, field, 16),
                              temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                              top_k=top_k, seed=seed, stop=tuple(stop),
                              ignore_eos=_boolean(body, "ignore_eos"),
                              expert_top_k=_integer(body, "expert_top_k"))
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _check_text(text: str, name: str) -> None:
    """A JSON string may hold a lone surrogate ("\\ud800"), which no tokenizer can encode: a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{name} holds an unpaired UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not text; send valid Unicode") from None


def _message(m, i: int) -> dict:
    """One chat message in the forms the OpenAI API allows, as {role, content: str} (plus the tool
    fields a template may render): content as a string, a list of text parts (joined with newlines),
    or null in an assistant message that carries tool_calls. Non-text parts are refused by type."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object with role and content, got {_show(m)}")
    role = m.get("role", "user")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                if not isinstance(part, dict) or not isinstance(kind, str):
                    raise BadRequest(f"{where}.content[{j}] must be a part object like {{\"type\": \"text\", "
                                     f"\"text\": ...}}, got {_show(part)}")
                raise BadRequest(f"{where}.content[{j}] has type {_show(kind)}: only text parts are implemented by "
                                 "this server (the model reads text); send the text, or leave the part out")
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}].text must be a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None and role == "assistant" and m.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of text parts, got {_show(content)} (null is "
                         "allowed in an assistant message with tool_calls)")
    _check_text(content, f"{where}.content")
    out = {"role": role, "content": content}
    for key in ("name", "tool_call_id", "tool_calls"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _prompt_from(body: dict, tokenizer, chat: bool, max_chars: int, max_messages: int = 4096):
    """The request's prompt (text or token ids), its size checked before anything tokenizes it.
    Renders a chat template, so the server calls it off the event loop."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects with role one of "
                             f"{', '.join(ROLES)}")
        if len(messages) > max_messages:
            raise TooLarge(f"messages has {len(messages)} entries; this server allows at most {max_messages} "
                           "(--max-messages)")
        messages = [_message(m, i) for i, m in enumerate(messages)]
        chars = sum(len(m["content"]) for m in messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
            raise BadRequest(f"prompt holds {len(prompt)} prompts: several prompts in one request are not "
                             "implemented by this server; send one request per prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise BadRequest("prompt must be a string or a non-empty list of token ids (integers)")
        chars = len(prompt) if isinstance(prompt, str) else 0
    if chars > max_chars:
        raise TooLarge(f"the prompt has {chars} characters; this server allows at most {max_chars} "
                       "(--max-prompt-chars)")
    if not chat and isinstance(prompt, str):
        _check_text(prompt, "prompt")
    return _chat_prompt(tokenizer, messages) if chat else prompt


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
    no_tokens = type(limit) in (int, float) and limit == 0   # 0 or 0.0, as 16.0 is read as 16
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


def check_api_key(api_key: str) -> None:
    """An empty or blank key is refused: it must never read as "no authentication"."""
    if not isinstance(api_key, str) or not api_key.strip():
        raise ValueError("the API key is empty, which would turn authentication off; give a non-empty key")


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path but /health (pure ASGI: streaming and disconnects pass)."""

    def __init__(self, app, api_key: str):
        check_api_key(api_key)
        self.app = app
        self.expected = api_key.encode()

    def authorized(self, header: bytes) -> bool:
        """``Bearer KEY`` with the scheme in any case (RFC 7235: auth schemes are case-insensitive)."""
        scheme, _, given = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            if not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
                response = JSONResponse({"error": {"message": "missing or wrong API key: send the header "
                                                   "'Authorization: Bearer KEY' with the server's --api-key",
                                                   "type": "authentication_error", "code": 401}},
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(llm: EngineClient, model_name: str = "moetailor", plans: dict | None = None, guard: bool = True,
               limits: ServerLimits | None = None, api_key: str | None = None):
    """The FastAPI app. ``plans``: name -> Plan selectable per request through ``expert_plan``.
    ``guard``: turn on the collapse guard (engine/guard.py) when the engine has none yet.
    ``limits``: request size bounds. ``api_key``: required as a Bearer token on every path but /health."""
    from ..plans.plan import uniform_plan
    from .disagg import WorkerUnavailable

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

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="moetailor", lifespan=lifespan)
    app.state.engine = engine
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    def error(status: int, message: str, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    def resolve_plan(body: dict):
        name = body.get("expert_plan")
        if name is None or name == "default":
            return None, None
        if not isinstance(name, str) or name not in plans:
            if llm.model is None:   # disaggregated: the decode worker holds one pool
                raise BadRequest(f"unknown expert_plan {_show(name)}; a disaggregated server has only \"default\" "
                                 "(the decode worker's pool); use expert_top_k, or a colocated server for plans")
            raise BadRequest(f"unknown expert_plan {_show(name)}; this server has: "
                             f"{', '.join(['default', *sorted(plans)])} (start it with --expert-plan NAME=PATH to "
                             "add one)")
        return plans[name], name

    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            raise TooLarge(f"the request body has {int(declared)} bytes; this server allows at most "
                           f"{limits.max_request_bytes} (--max-request-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_request_bytes:
                raise TooLarge(f"the request body is over {limits.max_request_bytes} bytes; this server allows at "
                               f"most that (--max-request-bytes)")
            chunks.append(chunk)
        data = b"".join(chunks)
        try:   # a big body parses off the event loop (8 MiB takes ~0.1 s)
            body = await asyncio.to_thread(json.loads, data) if len(data) > 2**16 else json.loads(data)
        except (ValueError, RecursionError):   # also bad UTF-8 and integers of thousands of digits
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise BadRequest(f"unknown model {_show(body.get('model'))}; this server serves {model_name!r}")
        return body

    async def run(request: Request, chat: bool):
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            body = await read_body(request)
            extra = _logprob_request(body, chat)
            # echo with max_tokens 0 scores the prompt: one token is generated (and dropped) to run the prefill
            one_token = {**body, "max_tokens": 1, "max_completion_tokens": None}
            sampling = _sampling_from(body if extra.generate else one_token, limits)
            if (extra.top is not None or extra.echo) and llm.tokenizer is None:
                raise BadRequest("logprobs and echo need the model's tokenizer to return token text; serve a "
                                 "checkpoint directory that has tokenizer files")
            if extra.top is not None:
                sampling = replace(sampling, logprobs=extra.top, prompt_logprobs=extra.top if extra.echo else None)
            plan, plan_key = resolve_plan(body)
            prompt = await asyncio.to_thread(_prompt_from, body, llm.tokenizer, chat, max_prompt_chars,
                                             limits.max_messages)
            echo_text, echo_ids = await asyncio.to_thread(llm.encode, prompt) if extra.echo else (None, [])
            if extra.echo and echo_text is None:
                echo_text = llm.tokenizer.decode(echo_ids)
            request_id, queue, prompt_tokens = await asyncio.to_thread(
                engine.submit, asyncio.get_running_loop(), prompt, sampling, plan, plan_key)
        except TooLarge as e:
            return error(413, str(e))
        except ValueError as e:
            return error(400, str(e))
        except WorkerUnavailable as e:
            return error(503, f"{e}; see /health", "server_unavailable")
        except Exception:
            log.exception("request %s failed before it reached the engine", oid)
            return error(500, f"internal error for request {oid}; the server log has the details", "server_error")
        oid = ("chatcmpl-" if chat else "cmpl-") + request_id
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def decode(ids: list[int]) -> str:
            return llm.tokenizer.decode(ids)

        def choice(out: _Collected, streaming: bool, echoed: bool = False, offset: int = 0,
                   context: list[int] = ()) -> dict:
            """The choice from what the request produced; ``echoed``: its prompt was already returned
            (streaming), ``offset``: characters already returned (text_offset), ``context``: their tokens."""
            reason = out.finish_reason
            text, token_ids, entries = out.text, out.token_ids, out.logprobs
            if not extra.generate:   # echo with max_tokens 0: only the prompt comes back
                text, token_ids, entries, reason = "", [], [], "length" if reason is not None else None
            if chat:
                key = "delta" if streaming else "message"
                result = {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
                if extra.top is not None:
                    result["logprobs"] = chat_logprobs(entries, decode)
                return result
            if extra.echo and not echoed:
                text, token_ids = echo_text + text, echo_ids + token_ids
                entries = [*(out.prompt_logprobs or [None] * len(echo_ids)), *entries]
            logprobs = completion_logprobs(entries, token_ids, decode, offset, context[-8:]) \
                if extra.top is not None else None
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

        def failure(delta: StreamDelta) -> str:
            log.error("request %s ended with an error: %s", oid, delta.error)
            return f"generation failed for request {oid}: {delta.error}"

        def usage(completion_tokens: int) -> dict:
            completion_tokens = completion_tokens if extra.generate else 0
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        if body.get("stream"):
            # stream_options.include_usage (OpenAI): every chunk has "usage": null, and one more chunk with no
            # choices and the request's usage comes before [DONE]
            with_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events():
                finished, returned, echoed, context, generated = False, 0, False, [], 0
                head = {"id": oid, "object": kind + (".chunk" if chat else ""), "created": created,
                        "model": model_name}
                try:
                    while True:
                        delta: StreamDelta = await queue.get()
                        if delta.error:
                            yield f"data: {json.dumps({'error': {'message': failure(delta), 'type': 'engine_error'}})}\n\n"
                        c = choice(_Collected.of([delta]), True, echoed=echoed, offset=returned, context=context)
                        shown = [*(echo_ids if extra.echo and not echoed else []), *delta.token_ids]
                        echoed, returned = True, returned + len(c.get("text", ""))
                        context, generated = (context + shown)[-8:], generated + len(delta.token_ids)
                        chunk = {**head, "choices": [c], **({"usage": None} if with_usage else {})}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        if delta.finished:
                            finished = True
                            break
                    if with_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(generated)})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not finished:   # client went away: free the request's KV blocks
                        engine.abort(request_id)
            return StreamingResponse(events(), media_type="text/event-stream")

        deltas = []
        disconnected = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():              # the client went away: stop generating for it now
                    getter.cancel()
                    engine.abort(request_id)
                    return error(499, "client disconnected")
                delta = getter.result()
                deltas.append(delta)
                if delta.finished:
                    break
        except asyncio.CancelledError:
            engine.abort(request_id)
            raise
        finally:
            disconnected.cancel()
        if deltas[-1].finish_reason == "error":
            return error(500, failure(deltas[-1]), "engine_error")
        out = _Collected.of(deltas)
        return {"id": oid, "object": kind, "created": created, "model": model_name,
                "choices": [choice(out, False)], "usage": usage(len(out.token_ids))}

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
            return error(404, f"unknown model {_show(model_id)}; this server serves {model_name!r}", "not_found_error")
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
            body = await read_body(request)
            tok = tokenizer()
            prompt, special = body.get("prompt"), body.get("add_special_tokens", False)
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string")
            if not isinstance(special, bool):
                raise BadRequest(f"add_special_tokens must be true or false, got {special!r}")
            if len(prompt) > max_prompt_chars:
                raise TooLarge(f"the prompt has {len(prompt)} characters; this server allows at most "
                               f"{max_prompt_chars} (--max-prompt-chars)")
            _check_text(prompt, "prompt")
        except TooLarge as e:
            return error(413, str(e))
        except ValueError as e:
            return error(400, str(e))
        tokens = list(await asyncio.to_thread(tok.encode, prompt, add_special_tokens=special))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """Ids in the tokenizer's vocabulary (an id past it decoded to "" silently, a negative one was a 500),
        at most --max-detokenize-ids of them, decoded off the event loop."""
        try:
            body = await read_body(request)
            tok = tokenizer()
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadRequest("tokens must be a list of token ids (integers)")
            if len(tokens) > max_ids:
                raise TooLarge(f"tokens has {len(tokens)} ids; this server allows at most {max_ids} "
                               "(--max-detokenize-ids)")
            size = len(tok)
            bad = next((t for t in tokens if not 0 <= t < size), None)
            if bad is not None:
                raise BadRequest(f"tokens holds {_show(bad)}, outside the tokenizer's vocabulary (0..{size - 1})")
        except TooLarge as e:
            return error(413, str(e))
        except ValueError as e:
            return error(400, str(e))
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

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(llm), media_type="text/plain; version=0.0.4")

    return app


def prometheus_text(llm: EngineClient) -> str:
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
    workers = llm.health()["workers"]
    if workers:   # disaggregated: one line per worker
        lines += ["# HELP moetailor_worker_up Worker process ready (1) or not (0: starting, dead or down).",
                  "# TYPE moetailor_worker_up gauge"]
        lines += [f'moetailor_worker_up{{worker="{k}"}} {int(w["state"] == "ready")}' for k, w in workers.items()]
        lines += ["# HELP moetailor_worker_restarts_total Times a worker was replaced after it died.",
                  "# TYPE moetailor_worker_restarts_total counter"]
        lines += [f'moetailor_worker_restarts_total{{worker="{k}"}} {w["restarts"]}' for k, w in workers.items()]
    if llm.guard is not None and llm.guard.enabled:
        lines.extend(guard_metrics(llm.guard.snapshot()))
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
        "guard_window_budget_hit_share": ("gauge", "Share of recent requests (those whose length says something) that "
                                                  "ran to max_tokens past the full pool's overrun limit."),
        "guard_window_p90_tokens": ("gauge", "p90 output length of recent requests that ended on EOS."),
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
    try:
        return chat_prompt(tokenizer, messages)
    except Exception as e:   # e.g. a template that wants alternating user/assistant turns
        raise BadRequest(f"the model's chat template rejected these messages: {str(e)[:200]}") from None


class _OnceLog:
    """A warning logged once per ``every`` seconds however often it happens (a flood of refused
    connections must not fill the log)."""

    def __init__(self, every: float = 60.0):
        self.every, self.last, self.count = every, -math.inf, 0

    def __call__(self, message: str, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.warning(message + " (%d times so far; logged at most once a minute)", *args, self.count)


def http_protocol(limits: ServerLimits):
    """uvicorn's h11 protocol with the connection bounds of ``limits``: a connection that sends nothing
    for ``idle_timeout_s`` (before its first request or after a response) or has not completed a request
    head ``header_timeout_s`` after its first byte is closed; above ``max_connections`` open connections
    a new one is answered 503 and closed at once (logged once a minute), so idle sockets can never use
    up the process's file descriptors."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    shed = _OnceLog()
    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n")
    message = json.dumps({"error": {"message": f"too many open connections (--max-connections "
                                               f"{limits.max_connections}); retry later",
                                    "type": "server_unavailable", "code": 503}}).encode()

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self._deadline, self._awaiting_head, self._shed = None, True, False
            if len(self.connections) >= limits.max_connections:
                self._shed = True
                shed("shedding load: %d connections open (--max-connections %d); new ones get 503",
                     len(self.connections), limits.max_connections)
                transport.write(busy % len(message) + message)
                transport.close()
                self.transport = transport
                return
            super().connection_made(transport)
            self._arm(limits.idle_timeout_s)

        def _arm(self, seconds: float | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expired) if seconds else None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _receive(self, data: bytes) -> None:
            if self._awaiting_head and not self._in_request():
                self._awaiting_head = False        # the first byte of a request head: its deadline starts
                self._arm(limits.header_timeout_s)
            super().data_received(data)
            if self._in_request():
                self._arm(None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_request():                 # a pipelined request already started
                self._arm(None)
            elif not self.transport.is_closing():
                self._awaiting_head = True
                self._arm(limits.idle_timeout_s)

        def data_received(self, data: bytes) -> None:   # a shed connection reads nothing
            if not self._shed:
                self._receive(data)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if not self._shed:
                super().connection_lost(exc)

    return BoundedH11Protocol


def _raise_fd_limit(limits: ServerLimits) -> None:
    """Lift the soft open-file limit to the hard one and keep --max-connections below it."""
    try:
        import resource
    except ImportError:   # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if limits.max_connections > soft - 256:
        log.warning("--max-connections %d is near the open-file limit %d: using %d", limits.max_connections, soft,
                    max(16, soft - 256))
        limits.max_connections = max(16, soft - 256)


def server_config(app, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
                  log_level: str = "info"):
    """The uvicorn configuration ``serve`` runs ``app`` with (tests start the same one)."""
    import uvicorn

    limits = limits or ServerLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http_protocol(limits),
                          timeout_keep_alive=math.ceil(limits.idle_timeout_s),
                          timeout_graceful_shutdown=math.ceil(limits.shutdown_timeout_s))


def serve(llm: EngineClient, host: str = "127.0.0.1", port: int = 8000, model_name: str = "moetailor",
          plans: dict | None = None, limits: ServerLimits | None = None, api_key: str | None = None,
          guard: bool = True) -> None:
    import uvicorn

    limits = limits or ServerLimits()
    _raise_fd_limit(limits)
    app = create_app(llm, model_name, plans, guard=guard, limits=limits, api_key=api_key)
    uvicorn.Server(server_config(app, host, port, limits)).run()
