"""What a request gets back: its final ``RequestOutput`` and, streaming, its ``StreamDelta``s (both
engines, colocated and disaggregated, build them with ``RequestOutput.of`` and ``delta``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A request's result (both engines return it)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" | "length" | "abort" | "error"; None while running
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    logprobs: list | None = None            # TokenLogprob per completion token (SamplingParams.logprobs)
    prompt_logprobs: list | None = None     # TokenLogprob per prompt token, first None (prompt_logprobs)

    @classmethod
    def of(cls, seq) -> "RequestOutput":
        return cls(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], seq.text,
                   list(seq.completion_token_ids), seq.finish_reason, seq.metrics(), seq.error,
                   None if seq.logprobs is None else list(seq.logprobs), seq.prompt_logprobs)


@dataclass
class StreamDelta:
    """What one request gained since it was last reported (streaming)."""
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None            # TokenLogprob of ``token_ids`` when the request asked for logprobs
    prompt_logprobs: list | None = None     # in the request's first delta, when asked for


def new_logprobs(seq, start: int, end: int) -> list | None:
    """The logprobs of completion tokens [start, end) of a sequence that asked for them (else None)."""
    logprobs = getattr(seq, "logprobs", None)
    return None if logprobs is None else logprobs[start:end]


def stop_prefix_len(text: str, stops) -> int:
    """Characters at the end of ``text`` that could begin a stop string (the longest such suffix):
    a stream holds them back until the next tokens show whether the stop string follows."""
    for n in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


def delta(seq, sent_text: int, sent_tokens: int) -> StreamDelta:
    """``seq``'s text and tokens past the first ``sent_text`` characters and ``sent_tokens`` tokens;
    a ``Sequence`` or the disaggregated front end's ``RemoteSequence`` (both engines stream with it).
    An unfinished text holds back an incomplete UTF-8 character at its end and any end that could
    be the start of a stop string, so nothing streamed ever turns out to belong to a stop string."""
    text = seq.text
    if not seq.is_finished:
        if text.endswith("\ufffd"):
            text = text[:-1]
        text = text[:len(text) - stop_prefix_len(text, seq.sampling.stop)]
    tokens = seq.completion_token_ids
    return StreamDelta(seq.request_id, text[sent_text:], list(tokens[sent_tokens:]), seq.is_finished,
                       seq.finish_reason, seq.error, new_logprobs(seq, sent_tokens, len(tokens)),
                       getattr(seq, "prompt_logprobs", None) if sent_tokens == 0 else None)
