"""The KV cache as a pool of fixed-size blocks; each sequence owns a table of block ids.

A token at position p of a sequence lives in slot ``block_table[p // block_size] * block_size
+ p % block_size`` of the pool. No prefix sharing: a block belongs to exactly one sequence.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


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
