"""DeepSeek's grouped routing (``n_group`` > 1), as the facts every technique needs about it; the one
place that knows these rules (docs/plans.md, "Grouped routing").

The masked router sets dropped experts' selection scores to -inf *before* the group score, so a group
scores the sum of its top-2 *kept* experts, and one keeping fewer than 2 scores -inf. A pruned
checkpoint keeps ``n_group`` and ``topk_group``; it routes exactly like the masked model when every
group keeps the same count c >= 2 and ``topk_group * c >= top_k``. ``checkpoint_problem`` says why a
kept set fails that; ``balanced_keep`` chooses one that passes.
"""
from __future__ import annotations

import torch

from .architectures import RouterSemantics


def fingerprint_semantics(fp: dict) -> RouterSemantics | None:
    """The grouped-routing facts a model fingerprint (plans, statistics) records; None when the
    router is not grouped (or the file predates these fields)."""
    if int(fp.get("n_group", 1) or 1) <= 1:
        return None
    return RouterSemantics(num_experts=int(fp["num_experts"]), top_k=int(fp["top_k"]), scoring="sigmoid-grouped",
                           normalise=True, n_group=int(fp["n_group"]), topk_group=int(fp["topk_group"]))


def is_grouped(sem: RouterSemantics) -> bool:
    return sem.scoring == "sigmoid-grouped" and sem.n_group > 1


def group_size(sem: RouterSemantics) -> int:
    return sem.num_experts // sem.n_group


def per_group_counts(ids, sem: RouterSemantics) -> list[int]:
    """How many of ``ids`` fall in each routing group."""
    size = group_size(sem)
    counts = [0] * sem.n_group
    for e in ids:
        counts[int(e) // size] += 1
    return counts


def min_per_group(sem: RouterSemantics) -> int:
    """The fewest experts per group a group-balanced kept set may have: 2 (the group score sums the
    top-2) and enough that the ``topk_group`` chosen groups hold top-k experts."""
    return max(2, -(-sem.top_k // sem.topk_group))


def checkpoint_problem(ids, sem: RouterSemantics) -> str | None:
    """Why a checkpoint keeping only ``ids`` would not route like the masked full model (None: it does)."""
    if not is_grouped(sem):
        return None
    counts = per_group_counts(ids, sem)
    need = min_per_group(sem)
    if len(set(counts)) > 1 or counts[0] < need:
        return (f"keeps {counts} experts in the {sem.n_group} routing groups (n_group); a pruned checkpoint needs "
                f"the same count in every group, at least {need} (the group score sums each group's top-2, and "
                f"topk_group={sem.topk_group} groups must hold top-k={sem.top_k})")
    return None


def per_group_budget(count: int, sem: RouterSemantics, where: str = "") -> int:
    """Experts kept per group for a layer keeping ``count`` experts group-balanced, or a clear error."""
    at = f"{where}: " if where else ""
    G, need = sem.n_group, min_per_group(sem)
    if count % G or count // G < need:
        options = [c * G for c in range(need, group_size(sem) + 1)]
        raise ValueError(f"{at}keeping {count} experts cannot be split evenly over the {G} routing groups "
                         f"(n_group={G}) with at least {need} per group; choose a count in {options}, or use "
                         "`moetailor plan --groups ignore` (masked serving only: such a plan cannot become a pruned "
                         "checkpoint)")
    return count // G


def balanced_keep(scores: torch.Tensor, count: int, sem: RouterSemantics, where: str = "") -> tuple[int, ...]:
    """``count`` experts, the same number from every group, ranked by ``scores`` [E] inside each group
    (ties: the lower id). Sorted ids."""
    per = per_group_budget(count, sem, where)
    size = group_size(sem)
    grouped = scores.view(sem.n_group, size)                                    # [G, E/G]
    order = torch.argsort(-grouped, dim=1, stable=True)[:, :per]               # [G, per]
    ids = order + torch.arange(sem.n_group)[:, None] * size
    return tuple(sorted(ids.reshape(-1).tolist()))


def unreachable(ids, sem: RouterSemantics) -> list[int]:
    """Kept experts a masked grouped router never selects: those alone in their group while at
    least ``topk_group`` groups keep 2 or more (their group scores -inf and never wins a slot)."""
    if not is_grouped(sem):
        return []
    counts = per_group_counts(ids, sem)
    if sum(c >= 2 for c in counts) < sem.topk_group:
        return []
    size = group_size(sem)
    return [int(e) for e in ids if counts[int(e) // size] < 2]


def chosen_groups(choice: torch.Tensor, sem: RouterSemantics) -> torch.Tensor:
    """The stock group rule on selection scores ``choice`` [T, E] (sigmoid + correction bias, -inf for
    experts a policy excludes): each group scores the sum of its top-2, the ``topk_group`` best win.
    Returns the chosen groups as a mask [T, G]."""
    grouped = choice.view(-1, sem.n_group, group_size(sem))                    # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)                      # [T, G]
    group_idx = group_scores.topk(sem.topk_group, dim=-1)[1]                   # [T, topk_group]
    return torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)


def split_order(sem: RouterSemantics, parts: int) -> torch.Tensor:
    """Where the sub-experts of an N-way split go [E*N]: entry c is the parent-major child index
    (e * N + p) placed at id c. Ungrouped routers keep parent-major order. A grouped router gets
    N * n_group sub-groups of E / n_group ids: sub-group g * N + p holds part p of every parent of
    group g, so each sub-group's top-2 (and score) equals its parent group's, the N * topk_group best
    sub-groups are exactly the N parts of the topk_group best groups (the node bound holds), and
    top-(N * k) inside them picks every part of the top-k parents: the split routes like the original."""
    if not is_grouped(sem):
        return torch.arange(sem.num_experts * parts)
    size = group_size(sem)
    g, p, j = torch.meshgrid(torch.arange(sem.n_group), torch.arange(parts), torch.arange(size), indexing="ij")
    return ((g * size + j) * parts + p).reshape(-1)


def same_group_only(loss: torch.Tensor, sem: RouterSemantics) -> torch.Tensor:
    """Fold losses L[src, dst] [E, E] with every cross-group pair set to inf (never a fold target)."""
    if not is_grouped(sem):
        return loss
    g = torch.arange(sem.num_experts, device=loss.device) // group_size(sem)   # [E] (groups: contiguous ids)
    return loss.masked_fill(g[:, None] != g[None, :], float("inf"))
