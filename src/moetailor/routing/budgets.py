"""The per-request expert budget rules, once: what ``expert_top_k`` may be and what a request runs at.

A request may ask for fewer experts per token than the model routes (None = the model's k).
``expert_top_k_value`` reads a JSON client's value (the engine's server, the vLLM plugin),
``validate_expert_top_k`` checks a budget against the model (every request an engine or the vLLM
plugin admits), ``budget_of`` is the k an admitted request runs at. They sit beside the routing
policy the budgets feed (``router.route`` trims each token to its budget) and the k-aware schedules
(``k_tiers``), so the engine and the vLLM plugin read them from one place.

``BudgetPolicy`` is what an engine step does with them: it turns a step's requests (their
``SamplingParams.expert_top_k``) into the per-token budget tensor the router trims with, decides
which requests share a step (``k_schedule``: ``mixed`` = any, each token at its own k; ``max`` =
everyone at the step's largest k, the baseline; ``tiers`` = offline groups by k; ``lanes`` = online
low-k / high-k decode lanes), and keeps the step-cost model those schedules plan with, refitted to
the engine's measured steps on request.
"""
from __future__ import annotations

import numbers

import torch

from .k_tiers import KRequest, OnlineLanes, StepCost, plan_offline


def _as_integer(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        text = repr(k)
        raise ValueError(f"expert_top_k must be an integer, got {text if len(text) <= 60 else text[:57] + '...'}")
    return int(k)


def expert_top_k_value(k) -> int | None:
    """A budget as a JSON client sent it (the server's parser, the vLLM plugin), before the model is
    known: None (the model's full budget) or an integer >= 1, where 16.0 reads as 16. Raises
    ValueError naming the field."""
    if k is None:
        return None
    if isinstance(k, float) and k.is_integer() and abs(k) < 2**53:
        k = int(k)
    k = _as_integer(k)
    if k < 1:
        raise ValueError(f"expert_top_k={k} is out of range: a token routes at least 1 expert; ask for a budget "
                         "of at least 1 or leave it unset for the full budget")
    return k


def validate_expert_top_k(k, max_k: int | None, parts: int | None = None) -> int | None:
    """A request's budget checked against the model (every request an engine admits passes here,
    ``validation.check_request``): an integer 1 <= k <= max_k (= N * k_max for a split model,
    ``parts`` = N); None means the full budget (max_k). ``max_k`` None: the model has no experts,
    so any budget is refused. Raises ValueError naming the range."""
    if k is None:
        return max_k
    if max_k is None:
        raise ValueError("expert_top_k applies to Mixture-of-Experts models; this model has no experts")
    k = _as_integer(k)
    if not 1 <= k <= max_k:
        what = f" ({parts} sub-experts x {max_k // parts} experts)" if parts else ""
        raise ValueError(f"expert_top_k={k} is out of range: this model routes 1..{max_k} experts per token{what}; "
                         f"ask for a budget in [1, {max_k}] or leave it unset for the full budget")
    return k


def budget_of(k: int | None, full_k: int) -> int:
    """The experts per token an admitted request runs at: its budget, never above the model's k
    (None = the model's k). The engine's ``BudgetPolicy`` and the vLLM plugin's routing and
    scheduler read a request's budget through it."""
    return full_k if k is None else min(int(k), full_k)


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

    def k_of(self, sampling) -> int:
        return budget_of(sampling.expert_top_k, self.full_k)

    # ---- a step --------------------------------------------------------------------------------
    def token_top_k(self, seqs: list, is_prefill: bool) -> tuple[torch.Tensor | None, int | None, float]:
        """Per-token expert budget [T], its max and mean; (None, None, k) when every request uses the model's k."""
        if all(s.sampling.expert_top_k is None for s in seqs):
            return None, None, float(self.full_k)
        per_seq = [self.k_of(s.sampling) for s in seqs]
        if self.schedule == "max":          # the baseline: everyone at the step's largest budget
            per_seq = [max(per_seq)] * len(per_seq)
        counts = [len(s) if is_prefill else 1 for s in seqs]
        per_token = [k for k, n in zip(per_seq, counts) for _ in range(n)]
        return torch.tensor(per_token, device=self.device), max(per_seq), sum(per_token) / len(per_token)

    def decode_group(self, group: list) -> set[str]:
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
    def tiers(self, params: list) -> list[list[int]]:
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
