"""Chooses each step's sequences. A step is all-prefill or all-decode, so it has one expert policy.

Prefill first: admit waiting sequences while slots, free blocks and the token budget allow.
Otherwise decode every running sequence, preempting (free blocks, recompute later) from the back
of the queue when the pool cannot hold the next token. Requests that chose a different expert plan
(``seq.plan_key``) never share a step: a step takes the group at the head of its queue, and a
decode step sends its group to the back so groups take turns.
"""
from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill) for the next step; empty when nothing can run."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if scheduled and seq.plan_key != scheduled[0].plan_key:
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
        key = self.running[0].plan_key if self.running else None
        while self.running:
            seq = self.running.popleft()
            if seq.plan_key != key:
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
