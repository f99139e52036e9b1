"""The per-request expert budget rules, once: what ``expert_top_k`` may be and what a request runs at.

A request may ask for fewer experts per token than the model routes (None = the model's k).
``expert_top_k_value`` reads a JSON client's value (the engine's server, the vLLM plugin),
``validate_expert_top_k`` checks a budget against the model (every request an engine or the vLLM
plugin admits), ``budget_of`` is the k an admitted request runs at. They sit beside the routing
policy the budgets feed (``router.route`` trims each token to its budget) and the k-aware schedules
(``k_tiers``), so the engine and the vLLM plugin read them from one place.
"""
from __future__ import annotations

import numbers


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
