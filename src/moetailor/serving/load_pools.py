"""Decode pools that follow the load (docs/techniques.md): each decode step of B sequences runs the
largest pool whose estimated step time meets the per-step SLO, else the smallest. The estimate is
``k_tiers.StepCost`` with the pool's size as the number of experts the union is drawn from:

    seconds(B, m') = fixed + per_token * B + L * (per_expert * m'(1 - (1 - k/m')^B) + per_route * B * k)

The rungs are colocated mask plans on one model, so they share the KV cache and a sequence may move
between pools from one step to the next.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..plans.plan import Plan
from ..routing.traffic import StepCost


@dataclass(frozen=True)
class PoolRung:
    plan: Plan | None          # decode policy of this pool (None = the full pool)
    pool_size: int             # experts per layer this pool keeps (mean over layers)
    min_batch: int = 1         # the decode batch from which this rung runs


def pool_size(plan: Plan | None, num_experts: int) -> int:
    """Mean experts kept per MoE layer by ``plan``'s decode policy."""
    if plan is None:
        return num_experts
    kept = [len(p.keep) if p.keep is not None else num_experts for p in plan.decode.layers.values()]
    return round(sum(kept) / len(kept)) if kept else num_experts


class PoolsByLoad:
    """Which decode pool a step of B sequences runs: ``rung_for(B)``; rungs sorted by ``min_batch``."""

    def __init__(self, rungs: list[PoolRung]):
        if not rungs:
            raise ValueError("pools by load need at least one pool")
        self.rungs = sorted(rungs, key=lambda r: r.min_batch)
        if self.rungs[0].min_batch > 1:
            raise ValueError(f"the smallest decode batch {self.rungs[0].min_batch} leaves batches below it without "
                             f"a pool; give one pool a threshold of 1")

    def rung_for(self, batch: int) -> PoolRung:
        chosen = self.rungs[0]
        for rung in self.rungs:
            if rung.min_batch <= batch:
                chosen = rung
        return chosen

    @classmethod
    def from_slo(cls, plans: list[Plan | None], cost: StepCost, slo_step_s: float, top_k: int,
                 max_batch: int) -> "PoolsByLoad":
        """Per batch 1..max_batch, the largest pool whose estimated step meets ``slo_step_s`` (else the
        smallest pool); each pool's threshold is the first batch that picks it."""
        if slo_step_s <= 0:
            raise ValueError(f"the step SLO {slo_step_s} s must be positive")
        sized = sorted(((pool_size(p, cost.num_experts), i, p) for i, p in enumerate(plans)), reverse=True)
        step = {m: dataclasses.replace(cost, num_experts=m) for m, _, _ in sized}
        first: dict[int, int] = {}
        for batch in range(1, max_batch + 1):
            fits = [(m, i) for m, i, _ in sized if step[m].seconds(top_k, batch) <= slo_step_s]
            m, i = fits[0] if fits else sized[-1][:2]
            first.setdefault(i, batch)
        rungs = [PoolRung(p, m, first[i]) for m, i, p in sized if i in first]
        if rungs and min(r.min_batch for r in rungs) > 1:
            rungs = [dataclasses.replace(r, min_batch=1) if r.min_batch == min(x.min_batch for x in rungs) else r
                     for r in rungs]
        return cls(rungs)

    def describe(self) -> str:
        return ", ".join(f"B>={r.min_batch}: {r.pool_size} experts" for r in self.rungs)
