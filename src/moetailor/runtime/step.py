"""The one object a forward pass is given, and the one place it is read from.

nano-vllm's ``utils/context.py`` shape: whoever runs a forward builds a ``Step`` and runs the model
inside ``running(step)``; paged attention (``runtime/attention.py``), every MoE router
(``routing/controller.py``) and the experts (``runtime/experts.py``) read ``current()``. The
engine's model runner builds one per engine step in ``prepare_prefill`` / ``prepare_decode``;
calibration, evaluation and distillation build a routing-only one through
``RoutingController.policy``. With no step (``model.generate``, plain transformers) every layer runs
its stock path.

A step is frozen and complete when the forward starts: layers read it and never add to it. What the
forward produces besides the logits is written into the step's output tensors, allocated before
the forward and filled in place so nothing waits on the host: ``experts_read`` (distinct experts
each MoE layer read) and, for the runner's one shape probe, ``probe``. ``read_experts`` turns the
first into the step's traffic, once, after the forward.
It lives here, below ``routing`` and ``engine``, because both read it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch


@dataclass(frozen=True)
class Routing:
    """Which experts every MoE layer runs this step (``routing.router.route`` applies it)."""
    policy: Mapping[int, Any] = field(default_factory=dict)  # MoE layer -> CompiledPolicy; absent = full router
    token_top_k: torch.Tensor | None = None   # [T] per-token expert budget, or None = the model's k
    k_max: int | None = None                  # max of token_top_k (one Python int per step)
    uniform: bool = False                     # every entry of token_top_k is k_max (one budget for the step)


FULL_ROUTING = Routing()


@dataclass(frozen=True)
class PagedKV:
    """Where an engine step's attention writes the new k/v and reads the cached ones."""
    cache: list                               # per attention layer (k, v): [N*bs, nKV, D]
    slot_mapping: torch.Tensor                # [T] pool slot of each new token
    block_size: int
    cu_seqlens: tuple[int, ...] | None = None  # prefill: token offsets of each sequence (len B+1)
    block_table: torch.Tensor | None = None   # decode: [B, nb] pool block ids of each sequence (0-padded)
    context_lens: torch.Tensor | None = None  # decode: [B] cached positions (new token included)
    kv_len: int = 0                           # decode: S, cached positions per sequence (padded)
    native: bool = False                      # decode: attention through the native ``paged_decode_attention``
    # decode without the kernel: pool slot of every cached position, as a slice of the pool (a lone
    # sequence with contiguous blocks) or [B*S]; kv_mask [B, 1, 1, S] (None = attend to all); the
    # gather buffers [B*S, nKV, D] by (k|v, (nKV, D), dtype), reused across steps (the runner's)
    kv_slots: torch.Tensor | slice | None = None
    kv_mask: torch.Tensor | None = None
    gather: Mapping[tuple, torch.Tensor] | None = None


@dataclass(frozen=True)
class NativeOps:
    """Which native ops (``moetailor/kernels``) an engine's decode steps run, decided once when the engine
    loads; the ops are called by name (``torch.ops.moetailor.*``) where they run. Prefill steps and
    routing-only steps run torch's ops (``TORCH_OPS``)."""
    router: bool = False   # softmax routers select through ``softmax_topk``
    norm: bool = False     # the decoders' RMSNorms run ``rms_norm``
    linear: bool = False   # the decoders' linear layers of a few rows run ``rows_linear`` (where it pays)


TORCH_OPS = NativeOps()


@dataclass(frozen=True)
class Step:
    is_prefill: bool
    routing: Routing = FULL_ROUTING
    kv: PagedKV | None = None                 # None: plain SDPA over the call's own k/v (no engine cache)
    experts: str = "loop"                     # "native" (the native experts op) | "grouped" | "loop" (runtime/experts.py)
    expert_weights: Mapping[int, tuple] | None = None  # MoE layer -> (gate_up, down) instead of the model's (a decode dtype, packed)
    native: NativeOps = TORCH_OPS             # which native ops the step runs (an engine's decode steps)
    # outputs, written in place by the forward
    experts_read: torch.Tensor | None = None  # [num layers] int64: distinct experts read (-1 = not a MoE layer)
    probe: dict | None = None                 # shape probe: attention layer -> (k shape, v shape, dtype)


def experts_read_buffer(num_layers: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh ``Step.experts_read``: one int64 per decoder layer, -1 until a MoE layer writes it."""
    return torch.full((num_layers,), -1, dtype=torch.long, device=device)


def read_experts(step: Step) -> dict[int, int]:
    """MoE layer -> distinct experts the step's forward read (one host read for all layers)."""
    if step.experts_read is None:
        return {}
    return {layer: n for layer, n in enumerate(step.experts_read.tolist()) if n >= 0}


_CURRENT: Step | None = None


def current() -> Step | None:
    return _CURRENT


@contextmanager
def running(step: Step) -> Iterator[Step]:
    """Run a forward under ``step`` (the previous step, if any, comes back afterwards)."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, step
    try:
        yield step
    finally:
        _CURRENT = previous
