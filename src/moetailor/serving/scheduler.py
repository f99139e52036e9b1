"""Chooses each step's sequences. A step is all-prefill or all-decode, so it has one expert policy.

Prefill first: admit waiting sequences while slots, free blocks and the token budget allow; else
decode every running sequence, preempting from the back when the pool cannot hold the next token.
Step groups (``seq.plan_key``, ``seq.tier``) never share a step: a step takes the group at the head
of its queue and a decode step sends it to the back, so groups take turns; the budget policy may
narrow a decode step to one lane (``budgets.BudgetPolicy.decode_group``).
"""
from __future__ import annotations

from collections import deque

from ..runtime.config import EngineConfig
from .block_manager import BlockManager
from .detokenizer import Detokenizer
from .sequence import Sequence, SequenceStatus


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
