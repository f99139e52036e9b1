"""The contract between the server and an engine: what ``AsyncEngine`` and the routes call. The
colocated ``LLM`` and the disaggregated front end (``disagg.DisaggregatedLLM``) both implement it,
so the server never probes its engine with ``getattr``."""
from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

from .sampling import SamplingParams
from .validation import RequestLimits


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: object | None     # None: token-id prompts only
    model: object | None         # the weights when they live in this process (colocated), else None
    guard: object | None         # the collapse guard (serving/guard.py) when it is on
    lock: threading.RLock        # held by a step; taken to change requests from another thread
    step_log: object             # recent StepRecords (for /metrics), possibly empty

    @property
    def max_model_len(self) -> int: ...

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt."""

    def request_limits(self) -> RequestLimits:
        """What a request may ask for (vocabulary, context, pool, expert budget)."""

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, plan=None, plan_key: str | None = None):
        """Queue a request (ValueError naming the limit when it can never run); returns its sequence,
        which has ``request_id``, ``num_prompt_tokens``, ``text``, ``completion_token_ids``, ``sampling``,
        ``finish_reason``, ``error`` and ``is_finished``."""

    def step(self) -> list:
        """Advance the requests in flight; returns the sequences that changed."""

    def poll(self) -> list:
        """While no request is in flight: whatever changed anyway (a worker that died), else []."""

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        """End a request and free what it holds; False when unknown or already finished."""

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict:
        """Queue and pool numbers for /metrics (``LLM.stats`` names the keys)."""

    def health(self) -> dict:
        """{"ok": bool, "workers": {kind: {"state", "pid", "restarts", ...}}} (colocated: no workers)."""

    def close(self) -> None:
        """Release processes and memory (the server calls it on shutdown)."""
