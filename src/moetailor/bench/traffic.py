"""Expert-weight traffic of a decode step: the quantity batched MoE decode is bound by.

A decode step with B sequences reads the union of the experts its tokens route to; its expected
size is ``routing.traffic.expected_distinct``. Measured counts come from the routes themselves
(index tensors [T, K], dropped routes written as the sentinel E).
"""
from __future__ import annotations

import torch

from ..routing.traffic import expected_distinct  # noqa: F401  (the benchmarks import it from here)


def distinct_experts(index: torch.Tensor, num_experts: int) -> int:
    """Distinct real experts in routes ``index`` [T, K] (the sentinel ``num_experts`` is no expert)."""
    flat = index.reshape(-1)                                                # [T*K]
    return int(torch.unique(flat[flat < num_experts]).numel())


def expert_bytes(hidden: int, width: int, bytes_per_param: int, gated: bool = True) -> int:
    """Weight bytes of one routed expert: gate+up+down (gated, 3*H*I) or up+down (2*H*I)."""
    return (3 if gated else 2) * hidden * width * bytes_per_param


def expected_expert_bytes(num_layers: int, num_experts: int, top_k: int, batch: int, bytes_per_expert: int) -> float:
    """Expected routed-expert bytes one decode step reads across all MoE layers."""
    return num_layers * expected_distinct(num_experts, top_k, batch) * bytes_per_expert


def measured_expert_bytes(distinct_per_layer: dict[int, int], bytes_per_expert: int) -> int:
    return sum(distinct_per_layer.values()) * bytes_per_expert


def ideal_speedup(full_bytes: float, pool_bytes: float) -> float:
    """The speedup a purely bandwidth-bound step would get from reading ``pool_bytes`` instead."""
    if pool_bytes <= 0:
        raise ValueError("pool_bytes must be positive")
    return full_bytes / pool_bytes


class RouteCounter:
    """Observer for ``RoutingController.observing``: distinct experts per layer of the last forward.
    ``with ctl.observing(counter): model(...)`` then ``counter.distinct`` -> {layer: count}."""

    def __init__(self) -> None:
        self.distinct: dict[int, int] = {}

    def __call__(self, layer, hidden, logits, weights, index) -> None:
        self.distinct[layer.index] = distinct_experts(index, layer.num_experts)  # index [T, K]

    def reset(self) -> None:
        self.distinct.clear()
