"""Merged-expert plans: which experts merge into one, with what weights (HC-SMoE, M-SMoE).

A layer keeping m' of E experts partitions them into m' groups; each becomes the members'
frequency-weighted average, with its representative's router row by default (``transforms.merge``
writes the checkpoint). The two groupings, the weights and the router rule: docs/plans.md, "Merged
experts".
"""
from __future__ import annotations

import torch

from ..tables import unknown_choice

MERGE_METHODS = {
    "hcsmoe": "HC-SMoE: hierarchical clustering (average linkage) of the experts' mean outputs",
    "msmoe": "M-SMoE: the most frequent experts are dominant, the others join the most similar (router rows)",
}


def average_linkage(features: torch.Tensor, clusters: int) -> list[list[int]]:
    """Agglomerative clustering of the rows of ``features`` [N, H] into ``clusters`` groups: average
    linkage on Euclidean distance (ties: the lowest pair of indices). Groups sorted by first member."""
    n = features.shape[0]
    if not 1 <= clusters <= n:
        raise ValueError(f"cannot make {clusters} clusters of {n} experts")
    x = features.double()
    dist = torch.cdist(x, x)                                                # [N, N]
    dist.fill_diagonal_(float("inf"))
    groups: dict[int, list[int]] = {i: [i] for i in range(n)}
    alive = torch.ones(n, dtype=torch.bool)
    while len(groups) > clusters:
        d = dist.masked_fill(~(alive[:, None] & alive[None, :]), float("inf"))
        flat = int(torch.argmin(d))                                         # row-major: the lowest (i, j) on ties
        i, j = sorted(divmod(flat, n))
        ni, nj = len(groups[i]), len(groups[j])
        merged = (ni * dist[i] + nj * dist[j]) / (ni + nj)                 # Lance-Williams, average linkage
        dist[i], dist[:, i] = merged, merged
        dist[i, i] = float("inf")
        alive[j] = False
        dist[j], dist[:, j] = float("inf"), float("inf")
        groups[i] += groups.pop(j)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def dominant_assignment(similarity: torch.Tensor, dominant: list[int]) -> list[list[int]]:
    """Each non-dominant expert joins the dominant expert of highest ``similarity`` [E, E] (ties: the
    lower id). Returns one group per dominant expert, the dominant first."""
    E = similarity.shape[0]
    doms = sorted(dominant)
    groups = {d: [d] for d in doms}
    cols = torch.tensor(doms)
    for e in range(E):
        if e in groups:
            continue
        best = doms[int(torch.argmax(similarity[e, cols].double()))]
        groups[best].append(e)
    return [groups[d] for d in doms]


def weighted_groups(groups: list[list[int]], frequency: torch.Tensor) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Each group as (id, weight) pairs, representative (most frequent; ties: lower id) first, weights
    f_e / sum f (uniform where no member was routed), rounded to 6 digits and summing to 1."""
    out = []
    for g in groups:
        f = frequency[list(g)].double()
        order = sorted(range(len(g)), key=lambda j: (-float(f[j]), g[j]))
        ids = [g[j] for j in order]
        fs = [float(f[j]) for j in order]
        total = sum(fs)
        ws = [x / total for x in fs] if total > 0 else [1.0 / len(ids)] * len(ids)
        ws = [round(w, 6) for w in ws]
        ws[0] = round(1.0 - sum(ws[1:]), 6)
        out.append(tuple(zip(ids, ws)))
    return tuple(out)


def router_rows(model) -> dict[int, torch.Tensor]:
    """Per MoE layer, the router weight [E, H] (float) of a loaded model or a router-only skeleton."""
    from ..models.adapters import moe_layers

    return {layer.index: layer.router.weight.detach().float().cpu() for layer in moe_layers(model)}


def merge_layer(method: str, stats_layer, count: int, protected: list[int], rows: torch.Tensor | None,
                scores: torch.Tensor | None = None, where: str = "") -> tuple[tuple[tuple[int, float], ...], ...]:
    """One layer's merge groups (``count`` of them) by ``method``; ``protected`` experts stay alone.
    ``scores`` rank the dominant experts of msmoe (default: routing frequency)."""
    E = stats_layer.num_experts
    freq = stats_layer.frequency
    if len(protected) >= count and protected:
        raise ValueError(f"{where}: {len(protected)} super experts to protect but only {count} merged experts; lower "
                         "--protect-super or keep more experts")
    rest = [e for e in range(E) if e not in protected]
    if method == "hcsmoe":
        means = stats_layer.mean_output_all if stats_layer.has_all_outputs else stats_layer.mean_output
        features = torch.nn.functional.normalize(means[rest].double(), dim=-1)              # [E - s, H]
        groups = [[rest[j] for j in g] for g in average_linkage(features, count - len(protected))]
        groups += [[e] for e in protected]
    elif method == "msmoe":
        if rows is None:
            raise ValueError("--merge msmoe groups experts by their router rows: give --model MODEL")
        s = (scores if scores is not None else freq).double().clone()
        s[protected] = float("inf")
        order = torch.argsort(-s, stable=True)
        dominant = sorted(order[:count].tolist())
        unit = torch.nn.functional.normalize(rows.double(), dim=-1)
        sim = unit @ unit.T                                                 # [E, E] cosine of router rows
        sim[:, protected] = float("-inf")                                   # protected experts take no one in
        for p in protected:
            sim[p, p] = float("inf")
        groups = dominant_assignment(sim, dominant)
    else:
        raise ValueError(unknown_choice("merge method", method, MERGE_METHODS))
    return weighted_groups(groups, freq)


def merge_policy_layers(method: str, stats, budgets: dict[int, int], protected: dict[int, list[int]],
                        model=None, router: str = "dominant", scores: dict[int, torch.Tensor] | None = None) -> dict:
    """{MoE layer: LayerPolicy} merging each layer's experts into its budget of groups."""
    from ..routing.policy import MERGE_ROUTERS, LayerPolicy

    if router not in MERGE_ROUTERS:
        raise ValueError(unknown_choice("merged router rule", router, MERGE_ROUTERS))
    if method == "hcsmoe":
        stats.require_outputs("--merge hcsmoe")
    rows = router_rows(model) if model is not None else None
    out = {}
    for i, count in sorted(budgets.items()):
        groups = merge_layer(method, stats.layers[i], count, protected.get(i, []),
                             rows[i] if rows is not None else None, scores[i] if scores else None, f"layer {i}")
        out[i] = LayerPolicy(keep=tuple(sorted(g[0][0] for g in groups)), pool_mode="merge", merge=groups,
                             merge_router=router)
    return out
