"""Chooses each step's sequences. A step is all-prefill or all-decode, so it has one expert policy.

Prefill first: admit waiting sequences while slots, free blocks and the token budget allow; else
decode every running sequence, preempting from the back when the pool cannot hold the next token.
Step groups (``seq.plan_key``, ``seq.tier``) never share a step: a step takes the group at the head
of its queue and a decode step sends it to the back, so groups take turns; the budget policy may
narrow a decode step to one lane (``budgets.BudgetPolicy.decode_group``).

A request as the engine sees it is a ``Sequence``: token ids, sampling state and its table of KV
blocks. The ``BlockManager`` hands out the pool's fixed-size blocks: a token at position p lives in
slot ``block_table[p // block_size] * block_size + p % block_size``; no prefix sharing, a block
belongs to exactly one sequence.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from enum import Enum, auto

import torch

from ..runtime.config import EngineConfig
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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.num_blocks <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of ``seq`` (its prompt, or prompt + completion after preemption)."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        seq.block_table = [self.free_blocks.popleft() for _ in range(seq.num_blocks)]

    def can_append(self, seq: Sequence) -> bool:
        """True when the next decode step can write the KV of ``seq``'s last token."""
        return len(seq.block_table) >= seq.num_blocks or self.num_free >= 1

    def may_append(self, seq: Sequence) -> None:
        """Add a block when the last token starts a new one."""
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self.free_blocks.popleft())

    def deallocate(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end) of ``seq``."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


class Detokenizer:
    """Incremental detokenization and stop strings: each update decodes only the newest tokens, with the
    token before them (a tokenizer may render a token differently at the start of a string); a
    window ending inside a multi-byte character waits. A finished sequence is decoded once in full
    and cut at the first stop string, so the final text never depends on how it was streamed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def resume(self, seq: Sequence) -> None:
        """A sequence that arrives with completion tokens (prefilled elsewhere): its text so far,
        decoded once; the next ``update`` starts after them."""
        seq.text = self._decode(seq.completion_token_ids)
        seq.detok_prefix = seq.detok_read = seq.num_completion_tokens
        seq.detokenizer = self

    def update(self, seq: Sequence) -> bool:
        """Extend ``seq.text`` by its new tokens; True when a stop string has appeared."""
        ids, start = seq.token_ids, seq.num_prompt_tokens
        prefix = self._decode(ids[start + seq.detok_prefix:start + seq.detok_read])
        window = self._decode(ids[start + seq.detok_prefix:])
        before, new = len(seq._text), window[len(prefix):]
        if new.endswith("\ufffd"):   # an incomplete UTF-8 sequence: keep the window open for the next token
            text = seq._text + new.rstrip("\ufffd")
        else:
            text = seq._text = seq._text + new
            seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids) - start
        stops = seq.sampling.stop
        if not stops:
            return False
        longest = max(map(len, stops))
        return any(text.find(s, max(0, before - longest + 1)) >= 0 for s in stops)

    def finalize(self, seq: Sequence) -> None:
        """The exact text of the completion, cut at the first stop string."""
        text = self._decode(seq.completion_token_ids)
        cut = min((i for i in (text.find(s) for s in seq.sampling.stop) if i >= 0), default=-1)
        seq.text = text[:cut] if cut >= 0 else text
        seq.detok_prefix = seq.detok_read = seq.num_completion_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, budgets=None, tokenizer=None,
                 eos_token_ids: set[int] = frozenset()):
        self.budgets = budgets              # a BudgetPolicy (decode lanes by expert budget), or None
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        seq.detokenizer = self.detokenizer
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> bool:
        """Join the decode batch with blocks allocated for KV computed elsewhere (True; the caller
        writes them), or, without a free slot or blocks, wait to be prefilled here (False)."""
        if self.detokenizer is not None:
            self.detokenizer.resume(seq)
        if len(self.running) >= self.max_num_seqs or not self.block_manager.can_allocate(seq):
            self.add(seq)
            return False
        self.block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill) for the next step; empty when nothing can run."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if scheduled and seq.step_group != scheduled[0].step_group:
                break
            if num_tokens + len(seq) > self.max_num_batched_tokens and scheduled:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += len(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        others: list[Sequence] = []
        chosen = self._decode_group()
        while self.running:
            seq = self.running.popleft()
            if seq.request_id not in chosen:
                others.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(others + scheduled))
        return scheduled, False

    def _decode_group(self) -> set[str]:
        """Request ids the next decode step runs: the head's step group, narrowed to one lane."""
        if not self.running:
            return set()
        key = self.running[0].step_group
        group = [s for s in self.running if s.step_group == key]
        return self.budgets.decode_group(group) if self.budgets is not None else {s.request_id for s in group}

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sequence's new token; finish (and release) those that hit a stop string,
        EOS, max_tokens or the context limit. Returns the finished ones."""
        finished = []
        for seq, token in zip(seqs, tokens):
            seq.append_token(token)
            p = seq.sampling
            reason = None
            if p.stop and self.detokenizer is not None and self.detokenizer.update(seq):
                reason = "stop"
            elif not p.ignore_eos and token in self.eos_token_ids:
                reason, seq.ended_on_eos = "stop", True
            elif seq.num_completion_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                reason = "length"
            if reason is not None:
                if self.detokenizer is not None:
                    self.detokenizer.finalize(seq)
                seq.finish(reason)
                self.finish(seq)
                finished.append(seq)
        return finished

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first; its prompt + completion are prefilled again."""
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is queued."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        if self.budgets is not None:
            self.budgets.forget(seq.request_id)
