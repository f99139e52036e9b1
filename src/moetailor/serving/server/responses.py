"""What a completion request gets back: one JSON object, or Server-Sent Events as its deltas arrive.

``Reply`` holds what every response of one request shares (its id, kind, prompt size, the echoed
prompt); ``collect`` answers a request that did not stream (a client that goes away mid-request is
aborted at once), ``stream`` one that did (an unfinished stream aborts its request when it closes).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..logprobs import CONTEXT_TOKENS, TokenText, chat_logprobs, completion_logprobs, fit_to_text
from ..outputs import StreamDelta
from .loop import AsyncEngine
from .requests import BodyTimeout, LogprobRequest, ModelNotFound, TooLarge

log = logging.getLogger("moetailor.server")


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | int | None = None,
          headers: dict | None = None) -> JSONResponse:
    """The OpenAI error object (``code``: the status unless the API names one, e.g. ``model_not_found``)."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status if code is None else code}},
                        status_code=status, headers=headers)


def refusal(e: Exception) -> JSONResponse:
    """The answer to a request refused before it reached the engine (``requests``' exceptions)."""
    if isinstance(e, ModelNotFound):
        return error(404, str(e), code="model_not_found")
    if isinstance(e, BodyTimeout):   # the rest of the body may still come: the connection cannot be reused
        return error(408, str(e), headers={"connection": "close"})
    return error(413 if isinstance(e, TooLarge) else 400, str(e))


@dataclass
class Collected:
    """What one request returned over its deltas: text, tokens and (when asked) logprobs."""
    text: str
    token_ids: list[int]
    logprobs: list
    prompt_logprobs: list | None
    finish_reason: str | None
    error: str | None

    @classmethod
    def of(cls, deltas: list[StreamDelta]) -> "Collected":
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        last = deltas[-1]
        return cls("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                   [e for d in deltas for e in (d.logprobs or [])], prompt,
                   last.finish_reason if last.finished else None, last.error)


@dataclass
class Reply:
    """One admitted request's response facts: ``text`` renders its tokens (logprobs), ``stops`` are
    its stop strings (a text cut at one ends its tokens there too)."""
    oid: str
    chat: bool
    model_name: str
    extra: LogprobRequest
    prompt_tokens: int
    text: TokenText | None
    stops: tuple[str, ...] = ()
    echo_text: str | None = None
    echo_ids: list[int] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def cut_at_stop(self, out: Collected) -> bool:
        """Whether the text ended at a stop string (so tokens past it are dropped): an EOS token is
        a special token and ends the text where it stands."""
        return (out.finish_reason == "stop" and bool(self.stops) and bool(out.token_ids)
                and out.token_ids[-1] not in self.text.special)

    def choice(self, out: Collected, streaming: bool, tokens: "Tokens | None" = None, first: bool = True) -> dict:
        """The choice from what the request produced (``out``: all of it, or a stream's delta).
        ``tokens``: the stream's token cursor (a reply that does not stream makes its own);
        ``first``: the stream's first chunk (it carries the echoed prompt, the chat role)."""
        extra = self.extra
        reason = out.finish_reason
        text, token_ids, entries = out.text, out.token_ids, out.logprobs
        if not extra.generate:   # echo with max_tokens 0: only the prompt comes back
            text, token_ids, entries, reason = "", [], [], "length" if reason is not None else None
        echo = extra.echo and first and not self.chat
        if echo:
            text, token_ids = self.echo_text + text, self.echo_ids + token_ids
            entries = [*(out.prompt_logprobs or [None] * len(self.echo_ids)), *entries]
        logprobs = None
        if extra.top is not None:
            tokens = tokens or Tokens(self)
            tokens.add(token_ids, entries, len(text))
            kept, pieces, cut = tokens.take(reason is not None, reason is not None and self.cut_at_stop(out))
            logprobs = (chat_logprobs(kept, self.text, cut) if self.chat
                        else completion_logprobs(kept, pieces, self.text, tokens.offset - sum(map(len, pieces))))
        if self.chat:
            key = "delta" if streaming else "message"
            message = {"role": "assistant", "content": text} if first or not streaming else {"content": text}
            result = {"index": 0, key: message, "finish_reason": reason}
            if extra.top is not None:
                result["logprobs"] = logprobs
            return result
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def failure(self, delta: StreamDelta) -> str:
        log.error("request %s ended with an error: %s", self.oid, delta.error)
        return f"generation failed for request {self.oid}: {delta.error}"

    def usage(self, completion_tokens: int) -> dict:
        completion_tokens = completion_tokens if self.extra.generate else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}


@dataclass
class Tokens:
    """The tokens (with their logprob entries) a reply returns, in step with its text: a token goes
    out once the text covering it has gone out, so a stream never returns a token that later turns
    out to lie inside a stop string, and the tokens of a finished reply end where its text ends."""
    reply: Reply
    ids: list[int] = field(default_factory=list)        # received, not yet returned
    entries: list = field(default_factory=list)
    context: list[int] = field(default_factory=list)    # the last tokens returned (how the next ones render)
    offset: int = 0                                     # characters of text the returned tokens cover
    text_end: int = 0                                   # characters of text returned

    def add(self, token_ids: list[int], entries: list, text_chars: int) -> None:
        self.ids += token_ids
        self.entries += entries
        self.text_end += text_chars

    def take(self, finished: bool, cut: bool) -> tuple[list, list[str], str | None]:
        """(entries, pieces, cut piece) of the tokens to return now. Unfinished: those whose text has
        been returned (a trailing token that ends inside a character waits for the next); finished:
        all, or with ``cut`` those that begin before the text's end, the one straddling it cut there
        (its piece is the third value)."""
        pieces = self.reply.text.pieces(self.ids, self.context[-CONTEXT_TOKENS:], final=finished)
        trimmed = None
        if finished and cut:
            kept = fit_to_text(pieces, self.offset, self.text_end)
            if kept and kept[-1] != pieces[len(kept) - 1]:
                trimmed = kept[-1]
            pieces = kept
        elif not finished:
            n, pos = 0, self.offset
            while n < len(pieces) and pos + len(pieces[n]) <= self.text_end:
                pos += len(pieces[n])
                n += 1
            while n and not pieces[n - 1]:
                n -= 1
            pieces = pieces[:n]
        n = len(pieces)
        entries = self.entries[:n]
        self.context = (self.context + self.ids[:n])[-CONTEXT_TOKENS:]
        self.ids, self.entries = self.ids[n:], self.entries[n:]
        self.offset += sum(map(len, pieces))
        return entries, pieces, trimmed


def stream(reply: Reply, queue: asyncio.Queue, engine: AsyncEngine, request_id: str,
           with_usage: bool) -> StreamingResponse:
    """The request's deltas as SSE chunks, then ``[DONE]``. ``with_usage`` (stream_options.include_usage,
    OpenAI): every chunk has "usage": null, and one more chunk with no choices and the request's usage
    comes before [DONE]."""
    async def events():
        finished, first, generated = False, True, 0
        tokens = Tokens(reply) if reply.extra.top is not None else None
        head = {"id": reply.oid, "object": reply.kind + (".chunk" if reply.chat else ""), "created": reply.created,
                "model": reply.model_name}
        try:
            while True:
                delta: StreamDelta = await queue.get()
                if delta.error:   # the error event, then the end of the choice (nothing of a failed step)
                    yield f"data: {json.dumps({'error': {'message': reply.failure(delta), 'type': 'engine_error'}})}\n\n"
                    delta = replace(delta, text="", token_ids=[], logprobs=None, prompt_logprobs=None)
                c = reply.choice(Collected.of([delta]), True, tokens, first)
                first, generated = False, generated + len(delta.token_ids)
                chunk = {**head, "choices": [c], **({"usage": None} if with_usage else {})}
                yield f"data: {json.dumps(chunk)}\n\n"
                if delta.finished:
                    finished = True
                    break
            if with_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': reply.usage(generated)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:   # client went away: free the request's KV blocks
                engine.abort(request_id)
    return StreamingResponse(events(), media_type="text/event-stream")


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(reply: Reply, queue: asyncio.Queue, engine: AsyncEngine, request_id: str, request: Request):
    """The whole completion as one object once the request finishes; 499 (and an abort) when the
    client disconnects first, 500 when the engine failed the request."""
    deltas = []
    disconnected = asyncio.ensure_future(wait_disconnect(request))
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
        return error(500, reply.failure(deltas[-1]), "engine_error")
    out = Collected.of(deltas)
    return {"id": reply.oid, "object": reply.kind, "created": reply.created, "model": reply.model_name,
            "choices": [reply.choice(out, False)], "usage": reply.usage(len(out.token_ids))}
