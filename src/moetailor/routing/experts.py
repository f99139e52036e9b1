"""moetailor's experts implementations: grouped by expert, touching only the routed union.

Both are registered in transformers' ``ExpertsInterface`` and share one contract: sentinel routes
(index E, from ``route``) cost nothing, and each call records how many distinct experts it read and
how many weight bytes that was (``TrafficMeter``), the quantity decode speed is bound by.

- "moetailor" (``loop_experts_forward``): a Python loop over the routed experts; runs any expert
  layout, and is what the controller installs for analysis and evaluation passes.
- "moetailor_grouped" (``grouped_experts_forward``): the routes, sorted by expert, go through
  ``grouped_mm`` once per projection; experts with no rows are skipped by the kernel (their weights
  are not read) and the per-expert call overhead, which bounds a small model's decode step,
  disappears. The engine selects it for its own steps (``experts_mode``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

IMPLEMENTATION = "moetailor"
GROUPED_IMPLEMENTATION = "moetailor_grouped"


@dataclass
class TrafficMeter:
    """Per forward pass: distinct experts read per MoE layer and expert weight bytes read."""

    enabled: bool = True
    distinct: dict[int, int] = field(default_factory=dict)   # layer -> distinct experts in the last call
    bytes_read: int = 0

    def reset(self) -> None:
        self.distinct.clear()
        self.bytes_read = 0

    def record(self, layer: int, n_experts: int, bytes_per_expert: int) -> None:
        self.distinct[layer] = n_experts
        self.bytes_read += n_experts * bytes_per_expert


def _record(self, n_distinct: int) -> None:
    meter = getattr(self, "_moetailor_meter", None)
    if meter is not None and meter.enabled:
        per_expert = (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()
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
    from transformers.integrations.moe import _grouped_mm

    if getattr(self, "has_bias", False) or getattr(self, "is_transposed", False) or not getattr(self, "has_gate", True):
        return loop_experts_forward(self, hidden_states, top_k_index, top_k_weights)   # layouts grouped_mm skips
    k = top_k_index.shape[1]                                                # [T, K]
    out = torch.zeros_like(hidden_states)                                   # [T, H]
    experts, slots = sorted_routes(top_k_index, self.num_experts)           # [S], [S]
    if slots.numel() == 0:                                                  # every route dropped
        _record(self, 0)
        return out
    rows = slots // k                                                       # [S] token of each route
    counts = torch.bincount(experts, minlength=self.num_experts)            # [E]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)                    # [E]
    x = hidden_states[rows]                                                 # [S, H]
    gate, up = _grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # [S, I]
    y = _grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)        # [S, H]
    out.index_add_(0, rows, (y * top_k_weights.reshape(-1)[slots, None]).to(out.dtype))
    _record(self, int((counts > 0).sum()))
    return out


def register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name, forward in ((IMPLEMENTATION, loop_experts_forward), (GROUPED_IMPLEMENTATION, grouped_experts_forward)):
        if name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(name, forward)


@contextmanager
def experts_mode(model, implementation: str | None):
    """Run the model's experts through ``implementation`` for the duration (None = leave as is)."""
    if implementation is None:
        yield
        return
    config = model.config
    previous = config._experts_implementation
    config._experts_implementation = implementation
    try:
        yield
    finally:
        config._experts_implementation = previous
