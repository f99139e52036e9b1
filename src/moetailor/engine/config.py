"""One configuration object for every part of the engine (scheduler, block manager, runner)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    max_num_seqs: int = 64                # sequences running at once
    max_num_batched_tokens: int = 4096    # prompt tokens admitted per prefill step
    max_model_len: int | None = None      # prompt + completion limit; None = min(model limit, 4096)
    block_size: int = 16                  # tokens per KV block
    num_kv_blocks: int | None = None      # None = from memory_budget, else enough for every slot at full length
    memory_budget: int | None = None      # bytes for weights + KV cache; KV gets what the weights leave
    dtype: torch.dtype = torch.float32    # weights and KV cache
    prefill_dtype: torch.dtype | None = None  # autocast dtype for prefill steps (bf16 matmuls pay for long prompts)
    device: str = "cpu"
    experts_impl: str = "grouped"         # "grouped": one grouped GEMM per projection; "loop": routing's per-expert loop

    EXPERTS_IMPLS = ("grouped", "loop")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.experts_impl not in self.EXPERTS_IMPLS:
            raise ValueError(f"experts_impl={self.experts_impl!r}; choose one of {self.EXPERTS_IMPLS}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be at least 1 (or None to size it automatically)")
