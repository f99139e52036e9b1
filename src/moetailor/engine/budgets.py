"""Per-request expert budgets in the engine: one owner for what ``SamplingParams.expert_top_k`` does.

A request may ask for fewer experts per token than the model routes (None = the model's k). The
``BudgetPolicy`` turns a step's requests into the per-token budget tensor the router trims with,
decides which requests share a step (``k_schedule``: ``mixed`` = any, each token at its own k;
``max`` = everyone at the step's largest k, the baseline; ``tiers`` = offline groups by k;
``lanes`` = online low-k / high-k decode lanes), and keeps the step-cost model those schedules plan
with, refitted to the engine's measured steps on request. The algorithms themselves are pure data
in ``routing/k_tiers.py``; this module wires them to sequences.

The budget rules themselves (``expert_top_k_value``, ``validate_expert_top_k``, ``budget_of``) are
``routing/budgets.py``'s, shared with the vLLM plugin.
"""
from __future__ import annotations

import torch

from ..routing.budgets import budget_of
from ..routing.k_tiers import KRequest, OnlineLanes, StepCost, plan_offline
from .sampling import SamplingParams
from .sequence import Sequence


class BudgetPolicy:
    def __init__(self, full_k: int, num_layers: int, num_experts: int, schedule: str = "mixed",
                 cost: StepCost | None = None, max_batch: int = 64, device: str | torch.device = "cpu",
                 parts: int | None = None):
        self.full_k = full_k                # the budget of a request that set none (the model's top-k)
        self.parts = parts                  # sub-experts per expert of a `moetailor split` model (messages)
        self.num_layers, self.num_experts = num_layers, num_experts
        self.schedule = schedule
        self.max_batch = max_batch
        self.device = device
        self.cost = cost                    # the k-aware schedules' throughput estimate
        self.lanes = OnlineLanes(cost, max_batch=max_batch) if schedule == "lanes" else None

    @classmethod
    def of(cls, model, schedule: str = "mixed", cost: StepCost | None = None, max_batch: int = 64,
           device: str | torch.device = "cpu") -> "BudgetPolicy":
        """The model's k and shapes; without ``cost``, ``StepCost.for_model``'s first estimate."""
        from ..models.adapters import moe_layers
        from ..models.sidecars import sidecars_of

        layers = moe_layers(model)
        split = sidecars_of(model).split
        return cls(layers[0].top_k, len(layers), layers[0].num_experts, schedule, cost or StepCost.for_model(model),
                   max_batch, device, split.parts if split else None)

    @property
    def limits(self) -> tuple[int, int | None]:
        """(largest budget a request may ask for, parts): what ``validate_expert_top_k`` checks against."""
        return self.full_k, self.parts

    def k_of(self, sampling: SamplingParams) -> int:
        return budget_of(sampling.expert_top_k, self.full_k)

    # ---- a step --------------------------------------------------------------------------------
    def token_top_k(self, seqs: list[Sequence], is_prefill: bool) -> tuple[torch.Tensor | None, int | None, float]:
        """Per-token expert budget [T], its max and mean; (None, None, k) when every request uses the model's k."""
        if all(s.sampling.expert_top_k is None for s in seqs):
            return None, None, float(self.full_k)
        per_seq = [self.k_of(s.sampling) for s in seqs]
        if self.schedule == "max":          # the baseline: everyone at the step's largest budget
            per_seq = [max(per_seq)] * len(per_seq)
        counts = [len(s) if is_prefill else 1 for s in seqs]
        per_token = [k for k, n in zip(per_seq, counts) for _ in range(n)]
        return torch.tensor(per_token, device=self.device), max(per_seq), sum(per_token) / len(per_token)

    def decode_group(self, group: list[Sequence]) -> set[str]:
        """Request ids of ``group`` (one step group) the next decode step runs: all, or one lane."""
        if self.lanes is None:
            return {s.request_id for s in group}
        batch = self.lanes.next_batch([KRequest(s.request_id, s.sampling.expert_top_k or self.full_k, s.arrival)
                                       for s in group])
        return set(batch.request_ids)

    def forget(self, request_id: str) -> None:
        if self.lanes is not None:
            self.lanes.forget(request_id)

    # ---- offline tiers -------------------------------------------------------------------------
    def tiers(self, params: list[SamplingParams]) -> list[list[int]]:
        """Offline k tiers: the request indices of each step group, in the order to queue them.
        ``plan_offline`` groups the requests by budget into batches (a residual tier merges upward
        when the cost model says so). Tokens still run at their own k (never below the budget)."""
        reqs = [KRequest(str(i), s.expert_top_k or self.full_k, float(i)) for i, s in enumerate(params)]
        return [list(map(int, b.request_ids)) for b in plan_offline(reqs, self.max_batch, self.cost)]

    # ---- the step-cost fit ---------------------------------------------------------------------
    def fit(self, step_log, min_steps: int = 8) -> StepCost:
        """Fit the step cost to measured decode steps (``StepRecord``s; ``StepCost.fit``) and plan with
        it from now on; run some decode steps at several budgets and batch sizes first."""
        samples = [(r.num_seqs, r.mean_k, sum(r.distinct_experts.values()) / max(1, len(r.distinct_experts)),
                    r.seconds) for r in step_log if r.phase == "decode"]
        if len(samples) < min_steps:
            raise ValueError(f"fitting the step cost needs {min_steps} measured decode steps, the log has "
                             f"{len(samples)}; generate some tokens first")
        self.cost = StepCost.fit(samples, self.num_layers, self.num_experts)
        if self.lanes is not None:
            self.lanes.cost = self.cost
        return self.cost
