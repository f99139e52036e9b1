"""The messages between the disaggregated front end and its workers (``disagg.py``), one dataclass
each. Front end -> worker through the worker's inbox queue: ``Add``, ``Adopt``, ``Abort``, ``Stop``;
worker -> front end through its pipe: ``Ready``, ``Failed``, ``Stats``, ``Heartbeat``, ``Delta`` and
``Handoff`` (a prefilled request: its delta for the client and the ``Adopt`` for the decode worker).
Everything is pickled by multiprocessing (KV tensors through shared memory: only handles are copied)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams


@dataclass(frozen=True)
class Add:
    """A new request for the prefill worker."""
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class Adopt:
    """A prefilled request for the decode worker: its tokens so far, sampler state and KV blocks."""
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    generator_state: torch.Tensor | None
    kv: list                                   # per layer (k, v) [n*bs, nKV, D], or None
    prompt: str | None
    logprobs: list | None
    prompt_logprobs: list | None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stop:
    """End the worker loop."""


@dataclass(frozen=True)
class Ready:
    kind: str
    info: dict                                 # num_blocks, weight_bytes, block_bytes, max_model_len, pid, limits


@dataclass(frozen=True)
class Failed:
    """The worker could not start: why (its own words)."""
    kind: str
    cause: str


@dataclass(frozen=True)
class Stats:
    kind: str
    stats: dict                                # LLM.stats() of the worker's engine


@dataclass(frozen=True)
class Heartbeat:
    kind: str


@dataclass(frozen=True)
class Delta:
    """A request's whole completion so far (deltas from two processes may arrive in any order)."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    stage: str                                 # "prefill" | "decode": the worker that holds it now
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class Handoff:
    """Prefill -> decode, through the front end: the client's delta and the decode worker's Adopt."""
    delta: Delta
    adopt: Adopt
