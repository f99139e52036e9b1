"""The engine's experts implementation: one grouped GEMM per projection over the routed union.

Same contract as ``routing.experts`` ("moetailor": sentinel routes cost nothing, the meter records
distinct experts and bytes), but the routes, sorted by expert, go through ``grouped_mm`` once per
projection instead of a Python loop over experts: experts with no rows are skipped by the kernel
(their weights are not read), and the per-expert call overhead disappears, which is what bounds a
decode step of a small model. The engine selects it for its own steps only (``experts_mode``).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

IMPLEMENTATION = "moetailor_grouped"


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.moe import _grouped_mm

    from ..routing.experts import moetailor_experts_forward

    if getattr(self, "has_bias", False) or getattr(self, "is_transposed", False) or not getattr(self, "has_gate", True):
        return moetailor_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    num_tokens, k = top_k_index.shape                                       # [T, K]
    E = self.num_experts
    flat = top_k_index.reshape(-1)                                          # [T*K]
    weights = top_k_weights.reshape(-1)
    valid = flat < E
    slots = torch.arange(flat.numel(), device=flat.device) if bool(valid.all()) else valid.nonzero()[:, 0]
    out = torch.zeros_like(hidden_states)                                   # [T, H]
    meter = getattr(self, "_moetailor_meter", None)
    if slots.numel() == 0:                                                  # every route dropped
        if meter is not None and meter.enabled:
            meter.record(getattr(self, "_moetailor_layer", -1), 0, 0)
        return out
    experts, order = torch.sort(flat[slots], stable=True)                   # [S] grouped by expert
    slots = slots[order]
    rows = slots // k                                                       # [S] token of each route
    counts = torch.bincount(experts, minlength=E)                           # [E]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)                    # [E]
    x = hidden_states[rows]                                                 # [S, H]
    gate, up = _grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # [S, I]
    y = _grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)        # [S, H]
    out.index_add_(0, rows, (y * weights[slots, None]).to(out.dtype))
    if meter is not None and meter.enabled:
        per_expert = (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()
        meter.record(getattr(self, "_moetailor_layer", -1), int((counts > 0).sum()), per_expert)
    return out


def register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, grouped_experts_forward)


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
