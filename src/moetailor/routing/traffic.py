"""The expected expert traffic of a batched step: what batched MoE decode is bound by.

A decode step with B sequences reads the union of the experts its tokens route to. With uniform,
independent routing over a pool of m experts and k routes per token, that union has expected size
m * (1 - (1 - k/m)^B) per layer (SlimWise).

``StepCost`` is the one step cost model built on it, per decode step of B sequences at budget k in
each of L MoE layers with m experts::

    seconds(k, B) = fixed + per_token * B + L * (per_expert * U(k, B) + per_route * B * k)
    U(k, B) = m * (1 - (1 - k/m)^B)       expected distinct experts a batch touches (uniform routing)

``per_expert`` is the cost of touching one expert's weights (bytes per expert / bandwidth on a
memory-bound machine, plus the per-call overhead of a small matmul), ``per_route`` the compute of
one token through one expert, ``per_token`` attention and the dense parts. The engine's k-aware schedules plan with it (first estimated from the model's shapes, then fitted to
measured steps: ``routing/k_tiers.py``), and the GPU roofline (``bench/roofline.py``) builds its
memory part (bytes / bandwidth) and its compute part (FLOPs / peak) as two of them.
"""
from __future__ import annotations

from dataclasses import dataclass


def expected_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts per layer for ``batch`` tokens routed uniformly: m(1-(1-k/m)^B)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}] (the pool size)")
    if batch < 0:
        raise ValueError(f"batch={batch} must be >= 0")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class StepCost:
    """The step cost model (the module's docstring has the formula); coefficients in seconds."""
    num_layers: int
    num_experts: int
    per_expert: float          # s to touch one expert (weights read + call overhead)
    per_route: float = 0.0     # s per (token, expert) pair
    per_token: float = 0.0     # s per sequence for attention and dense parts
    fixed: float = 0.0         # s per step

    def seconds(self, k: int, batch: int) -> float:
        if batch <= 0:
            return 0.0
        union = expected_distinct(self.num_experts, min(k, self.num_experts), batch) if k > 0 else 0.0
        moe = self.per_expert * union + self.per_route * batch * k
        return self.fixed + self.per_token * batch + self.num_layers * moe

    def throughput(self, k: int, batch: int) -> float:
        return batch / self.seconds(k, batch) if batch > 0 else 0.0

    def serve(self, k: int, n: int, max_batch: int) -> float:
        """Seconds for one decode step of ``n`` requests at ``k`` in batches of ``max_batch``."""
        full, rest = divmod(n, max_batch)
        return full * self.seconds(k, max_batch) + self.seconds(k, rest)

    @classmethod
    def from_bandwidth(cls, num_layers: int, num_experts: int, expert_bytes: int, bandwidth: float,
                       per_call: float = 0.0, **kw) -> "StepCost":
        """Memory-bound estimate: touching an expert costs its bytes / bandwidth (+ call overhead)."""
        return cls(num_layers, num_experts, expert_bytes / bandwidth + per_call, **kw)

    @classmethod
    def for_model(cls, model, bandwidth: float = 20e9, per_call: float = 3e-5, per_token: float = 2e-4,
                  fixed: float = 2e-3) -> "StepCost":
        """A first estimate from the model's shapes with rough CPU defaults (read bandwidth, per-expert
        call overhead, dense work per sequence, per-step overhead); ``LLM.fit_k_cost`` replaces it
        with a fit of the engine's own measured steps."""
        from ..models.adapters import moe_layers

        layers = moe_layers(model)
        return cls.from_bandwidth(len(layers), layers[0].num_experts, layers[0].expert_bytes(), bandwidth, per_call,
                                  per_token=per_token, fixed=fixed)

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float, float]], num_layers: int, num_experts: int) -> "StepCost":
        """Least-squares fit from measured steps ``(batch, k, mean distinct experts per layer, seconds)``
        (the engine's ``step_log`` has all four); coefficients clipped at 0."""
        import torch

        if len(samples) < 4:
            raise ValueError(f"fitting a step cost needs at least 4 measured steps (got {len(samples)})")
        X = torch.tensor([[1.0, b, num_layers * u, num_layers * b * k] for b, k, u, _ in samples], dtype=torch.float64)
        y = torch.tensor([[s] for *_, s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(X, y).solution[:, 0].clamp_min(0).tolist()
        return cls(num_layers, num_experts, per_expert=coef[2], per_route=coef[3], per_token=coef[1], fixed=coef[0])
