"""Per-layer pool sizes under a fixed total, from measured layer sensitivity.

For each MoE layer l and a few pool sizes m, ``cost[l][m]`` is the next-token KL to the full model
when only layer l is pooled to m (every other layer full). On the reference model the layers' KLs add up
nearly exactly (one layer at a time 0.116 summed, all layers together 0.109), so the allocation
minimises the sum: a knapsack over the layers, solved exactly by dynamic programming on the size
grid, with the curves linearly interpolated between the measured sizes. One set of curves gives an
allocation for every total, each of which the search then scores for real (the additive model is
only the proposal).
"""
from __future__ import annotations

import math
from typing import Callable


def grid(num_experts: int, top_k: int, step: int) -> list[int]:
    """Pool sizes a layer may take: multiples of ``step`` from the first one >= k, and E."""
    first = max(step, int(math.ceil(top_k / step)) * step)
    return sorted({*range(first, num_experts, step), num_experts})


def measured_sizes(num_experts: int, top_k: int, step: int, points: int = 7) -> list[int]:
    """The sizes each layer's curve is measured at: ``points`` sizes spread over the grid (E excluded:
    its KL is 0 by definition)."""
    g = [m for m in grid(num_experts, top_k, step) if m < num_experts]
    if len(g) <= points:
        return g
    return sorted({g[round(i * (len(g) - 1) / (points - 1))] for i in range(points)})


def interpolate(curve: dict[int, float], size: int, num_experts: int) -> float:
    """KL at ``size`` from a measured curve {size: KL} (KL(E) = 0), linear between measured sizes."""
    pts = sorted({**curve, num_experts: 0.0}.items())
    if size <= pts[0][0]:
        return pts[0][1]
    for (a, fa), (b, fb) in zip(pts, pts[1:]):
        if a <= size <= b:
            return fa + (fb - fa) * (size - a) / (b - a)
    return 0.0


def measure_curves(kl_of: Callable[[list[int]], float], num_layers: int, num_experts: int, sizes: list[int],
                   progress=None) -> list[dict[int, float]]:
    """``kl_of(per-layer sizes)`` for every layer alone pooled to every size in ``sizes``."""
    curves = []
    for layer in range(num_layers):
        curve = {}
        for m in sizes:
            alloc = [num_experts] * num_layers
            alloc[layer] = m
            curve[m] = kl_of(alloc)
            if progress is not None:
                progress()
        curves.append(curve)
    return curves


def allocate(curves: list[dict[int, float]], total: int, num_experts: int, top_k: int, step: int) -> list[int] | None:
    """Per-layer sizes on the grid summing to ``total`` that minimise the summed per-layer KL
    (exact dynamic programming); None when no allocation on the grid sums to ``total``."""
    g = grid(num_experts, top_k, step)
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for curve in curves:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for spent, (cost, sizes) in best.items():
            for m in g:
                s = spent + m
                if s > total:
                    break
                c = cost + interpolate(curve, m, num_experts)
                if s not in nxt or c < nxt[s][0] - 1e-15:
                    nxt[s] = (c, sizes + [m])
        best = nxt
    return best[total][1] if total in best else None
