"""moetailor's experts implementation: grouped by expert, touching only the routed union.

Registered in transformers' ``ExpertsInterface`` as "moetailor". Differences from the stock ones:
sentinel routes (index E) cost nothing, and each call records how many distinct experts it read
and how many weight bytes that was, which is the quantity decode speed is bound by.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

IMPLEMENTATION = "moetailor"


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


def moetailor_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    num_tokens, k = top_k_index.shape                                       # [T, K]
    out = torch.zeros_like(hidden_states)                                   # [T, H]
    flat = top_k_index.reshape(-1)                                          # [T*K]
    valid = (flat < self.num_experts).nonzero()[:, 0]
    order = valid[torch.argsort(flat[valid], stable=True)]                  # slots grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    weights = top_k_weights.reshape(-1)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        slots = order[start:start + count]
        start += count
        rows = slots // k
        gate, up = F.linear(hidden_states[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I]
        y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])                            # [n, H]
        out.index_add_(0, rows, (y * weights[slots, None]).to(out.dtype))
    meter = getattr(self, "_moetailor_meter", None)
    if meter is not None and meter.enabled:
        per_expert = (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()
        meter.record(getattr(self, "_moetailor_layer", -1), len(counts), per_expert)
    return out


def register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, moetailor_experts_forward)
