"""A request as the engine sees it: token ids, its KV block table and its sampling state."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from .sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


class Sequence:
    block_size = 16

    def __init__(self, token_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                 prompt: str | None = None, plan=None, plan_key: str | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling = sampling
        self.plan = plan                    # a per-request Plan, or None for the engine's plan
        self.plan_key = plan_key            # sequences with different keys never share a step
        self.tier: int | None = None        # offline k tier (k_schedule="tiers"): also never shares a step
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.ended_on_eos = False           # finished on an EOS token: its length is the model's choice
        self.error: str | None = None
        self._text = ""                     # completion text (stop strings already cut): read it as ``text``
        self.detokenizer = None             # the scheduler's: ``text`` is decoded when read (each step with stop strings)
        self.detok_prefix = 0               # incremental detokenization window: completion tokens
        self.detok_read = 0                 # [prefix, read) are context, [read, ...) not yet in text
        self.logprobs: list | None = [] if sampling.logprobs is not None else None   # TokenLogprob per completion token
        self.prompt_logprobs: list | None = None   # TokenLogprob per prompt token (first None), once prefilled
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(int(sampling.seed))
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def step_group(self) -> tuple:
        """Sequences share a step only within one group: same expert plan, same offline k tier."""
        return self.plan_key, self.tier

    @property
    def text(self) -> str:
        """The completion's text so far. Decoded when read (a stream, a finished request), not at every
        step: a request without stop strings that nobody streams is decoded once, when it finishes."""
        if self.detokenizer is not None and self.detok_read < self.num_completion_tokens and not self.is_finished:
            self.detokenizer.update(self)
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold the KV of every token so far."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(int(token_id))

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.detokenizer is not None and self.detok_read < self.num_completion_tokens:
            self.detokenizer.update(self)   # the text of every token so far: a finished text is never decoded again
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

    def metrics(self) -> dict:
        end = self.finish_time or time.perf_counter()
        ttft = (self.first_token_time - self.arrival) if self.first_token_time else None
        return {"ttft_s": ttft, "total_s": end - self.arrival, "num_preemptions": self.num_preemptions,
                "prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_completion_tokens}


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
    def of(cls, seq: Sequence) -> "RequestOutput":
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
