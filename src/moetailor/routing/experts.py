"""moetailor's experts implementation: grouped by expert, touching only the routed union.

One function is registered in transformers' ``ExpertsInterface`` ("moetailor", installed by the
routing controller) and it picks its path from the step context (``models.step_context``):

- in an engine step whose context carries the native kernel (the default on CPU): the routed
  tokens' SwiGLU experts in one C++ call (``moetailor/kernels``, ``native_experts_forward``), which
  pays one dispatch per layer instead of a library GEMM per expert;
- in an engine step with grouped experts: the routes, sorted by expert, go through
  ``grouped_mm`` once per projection (``grouped_experts_forward``); experts with no rows are
  skipped by the kernel (their weights are not read) and nothing waits on the host: per-expert
  counts and offsets stay on the device, dropped routes sort last and are masked out;
- otherwise (analysis and evaluation passes, or ``experts_impl="loop"``): a Python loop over the
  routed experts (``loop_experts_forward``), which runs any expert layout.

Both share one contract: sentinel routes (index E, from ``route``) cost nothing, and each call
records how many distinct experts it read (``TrafficMeter``; a device count, read once when the
meter is read), the quantity decode speed is bound by.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.step_context import get_context

IMPLEMENTATION = "moetailor"
GROUPED_IMPLEMENTATION = "moetailor_grouped"


class TrafficMeter:
    """Per forward pass: distinct experts read per MoE layer and expert weight bytes read. Layers
    record device counts; they are read back together, once, when ``distinct`` is first read."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._distinct: dict[int, int | torch.Tensor] = {}     # layer -> distinct experts (0-d tensor until read)
        self._bytes_per_expert: dict[int, int] = {}

    def reset(self) -> None:
        self._distinct.clear()
        self._bytes_per_expert.clear()

    def record(self, layer: int, n_experts: int | torch.Tensor, bytes_per_expert: int) -> None:
        self._distinct[layer] = n_experts
        self._bytes_per_expert[layer] = bytes_per_expert

    @property
    def distinct(self) -> dict[int, int]:
        """MoE layer -> distinct experts read in the last forward (one host read for all layers)."""
        pending = [layer for layer, n in self._distinct.items() if isinstance(n, torch.Tensor)]
        if pending:
            for layer, n in zip(pending, torch.stack([self._distinct[l] for l in pending]).tolist()):
                self._distinct[layer] = int(n)
        return self._distinct

    @property
    def bytes_read(self) -> int:
        return sum(n * self._bytes_per_expert[layer] for layer, n in self.distinct.items())


def _record(self, n_distinct: int | torch.Tensor, gu: torch.Tensor | None = None, down: torch.Tensor | None = None) -> None:
    meter = getattr(self, "_moetailor_meter", None)
    if meter is not None and meter.enabled:
        gu, down = (self.gate_up_proj, self.down_proj) if gu is None else (gu, down)
        per_expert = (gu.shape[1] * gu.shape[2] + down.shape[1] * down.shape[2]) * gu.element_size()
        meter.record(getattr(self, "_moetailor_layer", -1), n_distinct, per_expert)


def sorted_routes(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, slot) of every live route, sorted by expert (stable); slot s is token s // K's route.
    Sentinel routes (index >= num_experts) are left out."""
    flat = top_k_index.reshape(-1)                                          # [T*K]
    slots = (flat < num_experts).nonzero()[:, 0]                            # [S]
    experts, order = torch.sort(flat[slots], stable=True)
    return experts, slots[order]


def loop_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    k = top_k_index.shape[1]                                                # [T, K]
    out = torch.zeros_like(hidden_states)                                   # [T, H]
    experts, slots = sorted_routes(top_k_index, self.num_experts)           # [S], [S]
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    weights = top_k_weights.reshape(-1)
    start = 0
    for expert, count in zip(ids.tolist(), counts.tolist()):
        chunk = slots[start:start + count]
        start += count
        rows = chunk // k
        gate, up = F.linear(hidden_states[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I]
        y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])                            # [n, H]
        out.index_add_(0, rows, (y * weights[chunk, None]).to(out.dtype))
    _record(self, len(ids))
    return out


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routes sorted by expert through one ``grouped_mm`` per projection, without a host sync:
    dropped routes (index E) sort last, past the last offset, so the kernel never computes them
    and their rows are masked out. Decode steps use the decode copy of the weights when the engine
    made one (``StepContext.expert_weights``: e.g. bf16, which streams faster than fp32)."""
    from transformers.integrations.moe import _grouped_mm

    gu, down = self.gate_up_proj, self.down_proj                            # [E, 2I, H], [E, H, I]
    ctx = get_context()
    if ctx is not None and ctx.expert_weights:
        gu, down = ctx.expert_weights.get(getattr(self, "_moetailor_layer", -1), (gu, down))
    E, k = self.num_experts, top_k_index.shape[1]                           # top_k_index [T, K]
    flat = top_k_index.reshape(-1)                                          # [T*K]
    experts, order = torch.sort(flat, stable=True)                          # [T*K], sentinels last
    counts = torch.bincount(flat, minlength=E + 1)[:E]                      # [E]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)                    # [E]
    rows = order // k                                                       # [T*K] token of each route
    x = hidden_states[rows].to(gu.dtype)                                    # [T*K, H]
    gate, up = _grouped_mm(x, gu.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # [T*K, I]
    y = _grouped_mm(self.act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)   # [T*K, H]
    w = top_k_weights.reshape(-1)[order, None]                              # [T*K, 1]
    y = torch.where(experts[:, None] < E, y * w, 0.0)                      # rows past the offsets are garbage
    out = torch.zeros_like(hidden_states)                                   # [T, H]
    out.index_add_(0, rows, y.to(out.dtype))
    _record(self, (counts > 0).sum(), gu, down)
    return out


def native_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, kernel) -> torch.Tensor:
    """All routed experts in one native call (fp32 activations; fp32 or bf16 weights, the decode
    copy when the engine made one). Same contract as the other two: sentinels cost nothing, the
    meter gets the distinct-expert count."""
    gu, down = self.gate_up_proj, self.down_proj                            # [E, 2I, H], [E, H, I]
    ctx = get_context()
    if ctx.expert_weights:
        gu, down = ctx.expert_weights.get(getattr(self, "_moetailor_layer", -1), (gu, down))
    out, distinct = kernel(hidden_states.float().contiguous(), gu, down,    # [T, H], [] (experts read)
                           top_k_index.long().contiguous(), top_k_weights.float().contiguous())
    _record(self, distinct, gu, down)
    return out.to(hidden_states.dtype)


def native_layout(experts_module) -> bool:
    """Whether the native kernel runs this experts module: SwiGLU with a gate, no biases, the fused
    [E, 2I, H] / [E, H, I] layout, fp32 or bf16, and sizes in whole 16-wide vectors."""
    m = experts_module
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3 or down.dim() != 3:
        return False
    silu = isinstance(getattr(m, "act_fn", None), torch.nn.SiLU) or type(getattr(m, "act_fn", None)).__name__ == "SiLUActivation"
    E, two_i, H = gu.shape
    return (silu and getattr(m, "has_gate", True) and not getattr(m, "has_bias", False)
            and not getattr(m, "is_transposed", False) and gu.dtype in (torch.float32, torch.bfloat16)
            and down.dtype == gu.dtype and gu.is_contiguous() and down.is_contiguous()
            and tuple(down.shape) == (E, H, two_i // 2) and H % 16 == 0 and (two_i // 2) % 16 == 0)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered implementation: native or grouped in engine steps that ask for it, the loop
    otherwise."""
    ctx = get_context()
    if ctx is not None and ctx.native_experts is not None:
        native = getattr(self, "_moetailor_native", None)
        if native is None:
            native = self._moetailor_native = native_layout(self)
        if native:
            return native_experts_forward(self, hidden_states, top_k_index, top_k_weights, ctx.native_experts)
    grouped = ctx is not None and ctx.grouped_experts and getattr(self, "has_gate", True) and not (
        getattr(self, "has_bias", False) or getattr(self, "is_transposed", False))   # layouts grouped_mm skips
    forward = grouped_experts_forward if grouped else loop_experts_forward
    return forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name, forward in ((IMPLEMENTATION, experts_forward), (GROUPED_IMPLEMENTATION, grouped_experts_forward)):
        if name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(name, forward)
