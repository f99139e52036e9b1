"""The context of one engine step: built once per step, read by the layers that need it.

nano-vllm's ``utils/context.py`` shape: the engine's model runner calls ``set_context`` before the
forward and ``reset_context`` after; paged attention (``engine/attention.py``), the router
(``routing/controller.py``) and the experts (``routing/experts.py``) call ``get_context``. With no
context set (calibration, evaluation, ``model.generate``) every one of them runs its stock path.
It lives here, below both ``routing`` and ``engine``, because both read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class StepContext:
    is_prefill: bool
    # paged attention
    slot_mapping: torch.Tensor                  # [T] pool slot of each new token
    kv_cache: list | None = None                # per attention layer (k, v): [N*bs, nKV, D]
    block_size: int = 16
    cu_seqlens: list[int] | None = None         # prefill: token offsets of each sequence (len B+1)
    block_table: torch.Tensor | None = None     # decode: [B, nb] pool block ids of each sequence (0-padded)
    context_lens: torch.Tensor | None = None    # decode: [B] cached positions of each sequence (new token included)
    native_attention: Callable | None = None    # decode: the compiled paged attention kernel (moetailor/kernels)
    kv_slots: torch.Tensor | slice | None = None  # decode gather path: [B*S] pool slot of every cached position
    kv_mask: torch.Tensor | None = None         # decode: [B, 1, 1, S] True = attend; None = attend to all
    kv_len: int = 0                             # decode: S, cached positions per sequence (padded)
    kv_buffers: dict | None = None              # decode: reused gather buffers, (shape, dtype) -> tensor
    probe: dict | None = None                   # shape discovery: layer -> (k shape, v shape, dtype)
    # routing
    policy: dict = field(default_factory=dict)  # MoE layer -> CompiledPolicy of the step's phase
    token_top_k: torch.Tensor | None = None     # [T] per-token expert budget, or None = the model's k
    k_max: int | None = None                    # max of token_top_k (one Python int per step)
    # experts
    grouped_experts: bool = True                # grouped GEMM over the routed union (else a per-expert loop)
    expert_weights: dict | None = None          # MoE layer -> (gate_up, down) to use instead of the model's
    native_experts: Callable | None = None      # the compiled experts kernel, for steps it serves (moetailor/kernels)


_CONTEXT: StepContext | None = None


def get_context() -> StepContext | None:
    return _CONTEXT


def set_context(ctx: StepContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
