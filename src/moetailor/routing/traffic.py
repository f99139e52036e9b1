"""The expected expert traffic of a batched step: what batched MoE decode is bound by.

A decode step with B sequences reads the union of the experts its tokens route to. With uniform,
independent routing over a pool of m experts and k routes per token, that union has expected size
m * (1 - (1 - k/m)^B) per layer (SlimWise). The engine's cost model and the benchmarks both use it.
"""
from __future__ import annotations


def expected_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts per layer for ``batch`` tokens routed uniformly: m(1-(1-k/m)^B)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}] (the pool size)")
    if batch < 0:
        raise ValueError(f"batch={batch} must be >= 0")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)
