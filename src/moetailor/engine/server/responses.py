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
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..logprobs import chat_logprobs, completion_logprobs
from ..sequence import StreamDelta
from .loop import AsyncEngine
from .requests import LogprobRequest

log = logging.getLogger("moetailor.server")


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """The OpenAI error object."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


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
    """One admitted request's response facts: ``decode`` turns token ids into text (logprobs)."""
    oid: str
    chat: bool
    model_name: str
    extra: LogprobRequest
    prompt_tokens: int
    decode: Callable[[list[int]], str]
    echo_text: str | None = None
    echo_ids: list[int] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice(self, out: Collected, streaming: bool, echoed: bool = False, offset: int = 0,
               context: list[int] = ()) -> dict:
        """The choice from what the request produced; ``echoed``: its prompt was already returned
        (streaming), ``offset``: characters already returned (text_offset), ``context``: their tokens."""
        extra = self.extra
        reason = out.finish_reason
        text, token_ids, entries = out.text, out.token_ids, out.logprobs
        if not extra.generate:   # echo with max_tokens 0: only the prompt comes back
            text, token_ids, entries, reason = "", [], [], "length" if reason is not None else None
        if self.chat:
            key = "delta" if streaming else "message"
            result = {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
            if extra.top is not None:
                result["logprobs"] = chat_logprobs(entries, self.decode)
            return result
        if extra.echo and not echoed:
            text, token_ids = self.echo_text + text, self.echo_ids + token_ids
            entries = [*(out.prompt_logprobs or [None] * len(self.echo_ids)), *entries]
        logprobs = completion_logprobs(entries, token_ids, self.decode, offset, context[-8:]) \
            if extra.top is not None else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def failure(self, delta: StreamDelta) -> str:
        log.error("request %s ended with an error: %s", self.oid, delta.error)
        return f"generation failed for request {self.oid}: {delta.error}"

    def usage(self, completion_tokens: int) -> dict:
        completion_tokens = completion_tokens if self.extra.generate else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}


def stream(reply: Reply, queue: asyncio.Queue, engine: AsyncEngine, request_id: str,
           with_usage: bool) -> StreamingResponse:
    """The request's deltas as SSE chunks, then ``[DONE]``. ``with_usage`` (stream_options.include_usage,
    OpenAI): every chunk has "usage": null, and one more chunk with no choices and the request's usage
    comes before [DONE]."""
    async def events():
        finished, returned, echoed, context, generated = False, 0, False, [], 0
        head = {"id": reply.oid, "object": reply.kind + (".chunk" if reply.chat else ""), "created": reply.created,
                "model": reply.model_name}
        try:
            while True:
                delta: StreamDelta = await queue.get()
                if delta.error:
                    yield f"data: {json.dumps({'error': {'message': reply.failure(delta), 'type': 'engine_error'}})}\n\n"
                c = reply.choice(Collected.of([delta]), True, echoed=echoed, offset=returned, context=context)
                shown = [*(reply.echo_ids if reply.extra.echo and not echoed else []), *delta.token_ids]
                echoed, returned = True, returned + len(c.get("text", ""))
                context, generated = (context + shown)[-8:], generated + len(delta.token_ids)
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
