"""The one place a routing policy is applied: ``route`` turns router logits into routes.

A route is the pair the transformers experts module consumes: ``weights [T, K]`` and
``index [T, K]``. A dropped route has index E (the sentinel one past the last expert) and weight 0;
transformers' eager experts skip it and moetailor's experts implementation
(``runtime.experts``) never reads its weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.architectures import RouterSemantics
from ..models.groups import chosen_groups, same_group_only
from .policy import LayerPolicy


@dataclass
class FoldTables:
    """ExFold's per-layer calibration: scale[src, dst], relative loss[src, dst] (inf = unobserved)."""

    scale: torch.Tensor      # [E, E]
    loss: torch.Tensor       # [E, E]
    mean_norm: torch.Tensor  # [E] mean output norm, for batch importance


@dataclass
class CompiledPolicy:
    """A LayerPolicy turned into tensors on the model's device (built once per plan, not per step)."""

    policy: LayerPolicy
    keep_mask: torch.Tensor | None = None    # [E] bool
    pool_target: torch.Tensor | None = None  # [E] long: best kept expert per source (static fold)
    pool_scale: torch.Tensor | None = None   # [E] float: S[src, target], 0 where unobserved
    fold: FoldTables | None = None
    constants: torch.Tensor | None = None    # [E, H] float: novice constant c_e per expert (pool_mode "novice")

    @classmethod
    def build(cls, policy: LayerPolicy, sem: RouterSemantics, device, fold: FoldTables | None = None,
              constants: torch.Tensor | None = None) -> "CompiledPolicy":
        policy.validate(sem.num_experts, sem.top_k)
        if policy.merges:
            raise ValueError("this policy merges experts, which changes their weights: routing cannot apply it to the "
                             "original experts. Write the merged checkpoint (`moetailor prune MODEL PLAN --out DIR`) "
                             "and serve it (`moetailor generate DIR`, or decode on it: `--decode-model DIR`); `moetailor "
                             "eval MODEL --plan PLAN` does that for you")
        if policy.needs_constants and constants is None:
            raise ValueError("this policy replaces dropped experts by their constant outputs (novice experts) but no "
                             "constants were loaded: a plan names the statistics they come from in its \"fold_stats\" "
                             "(`moetailor plan STATS ... --novice` records them; calibrated with `moetailor calibrate`), "
                             "a novice checkpoint holds them as approx_value tensors")
        if policy.needs_fold_tables and fold is None:
            raise ValueError("this policy folds experts but no fold statistics were loaded: a plan names them in "
                             "its \"fold_stats\" (`moetailor plan`/`tune` record the statistics they were made from, "
                             "calibrated with `moetailor calibrate MODEL --fold`); `generate`/`serve` policy options "
                             "take --fold-stats STATS")
        keep_mask = pool_target = pool_scale = None
        if fold is not None:  # a grouped router folds only inside the source's group (models/groups.py)
            fold = FoldTables(fold.scale.to(device).float(), same_group_only(fold.loss.to(device).float(), sem),
                              fold.mean_norm.to(device).float())
        if policy.keep is not None:
            keep_mask = torch.zeros(sem.num_experts, dtype=torch.bool, device=device)
            keep_mask[list(policy.keep)] = True
            if policy.pool_mode == "fold":
                kept = torch.tensor(policy.keep, device=device)
                loss = fold.loss[:, kept]                                   # [E, m']
                best = loss.argmin(dim=1)                                   # [E]
                pool_target = kept[best]
                pool_scale = fold.scale.gather(1, pool_target[:, None])[:, 0].float()
                pool_scale = torch.where(torch.isinf(loss.min(dim=1).values), 0.0, pool_scale)
        if policy.needs_constants:
            if constants.shape[0] != sem.num_experts:
                raise ValueError(f"novice constants hold {constants.shape[0]} experts, the layer has {sem.num_experts}")
            constants = constants.to(device=device, dtype=torch.float32)
        else:
            constants = None
        return cls(policy, keep_mask, pool_target, pool_scale, fold, constants)


def select(logits: torch.Tensor, sem: RouterSemantics, k: int, allowed: torch.Tensor | None,
           bias: torch.Tensor | None = None, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock top-k routing restricted to ``allowed`` experts. Returns float weights, index [T, k].
    ``kernel``: the native ``softmax_topk`` op, which does a softmax router's selection in one call
    (engine decode steps; equal to the torch ops below up to float rounding; bf16 logits widened first,
    as below)."""
    if sem.scoring == "softmax" and kernel is not None:
        return kernel(logits.float().contiguous(), k, sem.normalise, allowed)
    if sem.scoring == "softmax":
        z = logits.float()                                                  # [T, E]
        if allowed is not None:
            z = z.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(z, dim=-1)
        weights, index = torch.topk(probs, k, dim=-1)                       # [T, k]
        if sem.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index
    scores = logits.float().sigmoid()                                       # [T, E]
    choice = scores + bias if bias is not None else scores
    if allowed is not None:
        choice = choice.masked_fill(~allowed, float("-inf"))
    if sem.n_group > 1:  # a group scores the sum of its top-2 kept experts (-inf if it keeps < 2): models/groups.py
        group_mask = chosen_groups(choice, sem)                             # [T, G]
        choice = choice.masked_fill(~group_mask.repeat_interleave(sem.num_experts // sem.n_group, dim=1), float("-inf"))
    top, index = choice.topk(k, dim=-1)                                     # [T, k]
    weights = scores.gather(1, index)
    if allowed is not None:  # chosen groups holding fewer than k kept experts: the rest are dropped routes
        usable = torch.isfinite(top)                                        # [T, k]
        weights = weights.masked_fill(~usable, 0.0)
        index = index.masked_fill(~usable, sem.num_experts)
    if sem.normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * sem.scaling, index


def route(logits: torch.Tensor, sem: RouterSemantics, cp: CompiledPolicy, bias: torch.Tensor | None = None,
          token_top_k: torch.Tensor | None = None, k_max: int | None = None, *, graph_safe: bool = False,
          counted: torch.Tensor | None = None, select_kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a compiled layer policy to router logits [T, E] -> (weights [T, K], index [T, K]).
    ``k_max`` is ``token_top_k.max()`` when the caller knows it (an engine step: one value per step).

    ``graph_safe`` (serving engines that trace or capture the step, e.g. vLLM): no host read of a
    per-step value, so one traced graph serves every step; budgets then trim from the policy's k
    (same routes). ``counted`` [T] bool: the tokens a batch-level pool ranks experts over (a step
    that mixes phases applies each phase's pool to its own tokens); None = all. ``select_kernel``:
    the native selection op for ``select`` (engine decode steps)."""
    p, E = cp.policy, sem.num_experts
    k = p.top_k or sem.top_k
    if token_top_k is not None and (k_max is not None or not graph_safe):  # budgets: route at the batch's largest k,
        largest = k_max if k_max is not None else int(token_top_k.max()) if token_top_k.numel() else k
        k = min(k, largest)                                                 # then trim each row
    allowed = cp.keep_mask if p.pool_mode == "mask" else None
    weights, index = select(logits, sem, k, allowed, bias, select_kernel)  # [T, k]

    if token_top_k is not None:
        beyond = torch.arange(k, device=index.device)[None, :] >= token_top_k[:, None]  # [T, k]
        weights, index = _drop(weights, index, beyond, E, renormalise=sem.normalise)
    if p.keep is not None and p.pool_mode not in ("mask", "novice"):   # novice routes stay: novice_split
        safe = index.clamp_max(E - 1)                                       # sentinels stay sentinels
        outside = (index < E) & ~cp.keep_mask[safe]                         # [T, k]
        if p.pool_mode == "fold":
            folded_w = weights * cp.pool_scale[safe]
            weights = torch.where(outside, folded_w, weights)
            index = torch.where(outside, cp.pool_target[safe], index)
            outside = outside & (folded_w == 0)                             # unobserved pairs are dropped
        weights, index = _drop(weights, index, outside, E, renormalise=False)
        if p.pool_mode == "fold":
            weights, index = _merge_duplicates(weights, index, E)
    if p.skip_beta is not None:
        ratio = weights / weights[:, :1].clamp_min(1e-20)
        weights, index = _drop(weights, index, ratio < p.skip_beta, E, renormalise=True)
    if p.token_keep is not None and p.token_keep < k:
        weights, index = _token_fold(weights, index, p.token_keep, cp.fold if p.fold else None, E)
    if p.batch_pool is not None:
        weights, index = _batch_pool(weights, index, p.batch_pool, cp.fold, p.fold, E, graph_safe, counted)
    return weights, index


def _drop(weights, index, drop, sentinel: int, renormalise: bool):
    """Turn the routes in ``drop`` into sentinels (expert index E); optionally rescale the rest to
    the old total."""
    kept = weights.masked_fill(drop, 0.0)
    if renormalise:
        kept = kept * (weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(1e-20))
    return kept, index.masked_fill(drop, sentinel)


def _token_fold(weights, index, keep: int, fold: FoldTables | None, E: int):
    """Each token keeps its ``keep`` strongest routes; the others fold onto the kept one with the
    lowest loss L[src, dst] (adding S[src, dst] * weight), or vanish when ``fold`` is None."""
    kept_w, kept_i = weights[:, :keep].clone(), index[:, :keep]            # [T, K]
    extra_w, extra_i = weights[:, keep:], index[:, keep:]                   # [T, k-K]
    if fold is not None:
        src = extra_i.clamp_max(E - 1)
        dst = kept_i.clamp_max(E - 1)
        loss = fold.loss[src[:, :, None], dst[:, None, :]]                  # [T, k-K, K]
        loss = loss.masked_fill((kept_i == E)[:, None, :], float("inf"))
        best = loss.argmin(dim=-1)                                          # [T, k-K]
        target = dst.gather(1, best)                                        # [T, k-K]
        gain = fold.scale[src, target] * extra_w                            # [T, k-K]
        usable = (extra_i < E) & torch.isfinite(loss.min(dim=-1).values)
        kept_w = kept_w.scatter_add(1, best, torch.where(usable, gain, 0.0).to(kept_w.dtype))
    return kept_w, kept_i


def _batch_pool(weights, index, pool_size: int, fold: FoldTables | None, do_fold: bool, E: int,
                graph_safe: bool = False, counted: torch.Tensor | None = None):
    """Keep the step's ``pool_size`` most important experts (sum of gate x mean output norm over the
    batch, or over the ``counted`` tokens); fold each route outside the pool onto its lowest-loss
    pool expert, or drop it. A step whose routes use at most ``pool_size`` experts is unchanged
    (``graph_safe``: decided by a tensor select instead of a host read)."""
    valid = index < E
    norm = fold.mean_norm[index.clamp_max(E - 1)] if fold is not None else torch.ones_like(weights)
    importance = torch.zeros(E + 1, device=weights.device, dtype=torch.float32)
    ranked = valid if counted is None else valid & counted[:, None]
    importance.scatter_add_(0, index.reshape(-1), (weights * norm * ranked).reshape(-1).float())
    importance = importance[:E]                                             # [E]
    if graph_safe:
        few = (importance > 0).sum() <= pool_size                           # [] bool, stays on the device
        pooled_w, pooled_i = _pool_routes(weights, index, importance, pool_size, fold, do_fold, E)
        return torch.where(few, weights, pooled_w), torch.where(few, index, pooled_i)
    if int((importance > 0).sum()) <= pool_size:
        return weights, index
    return _pool_routes(weights, index, importance, pool_size, fold, do_fold, E)


def _pool_routes(weights, index, importance, pool_size: int, fold: FoldTables | None, do_fold: bool, E: int):
    """The routes of ``_batch_pool`` once the step's experts outnumber the pool."""
    valid = index < E
    pool = importance.topk(pool_size).indices                               # [D]
    # index_fill_, not `in_pool[pool] = True`: the latter copies a host scalar, which a CUDA graph
    # capture refuses (vLLM captures the routing op on a GPU; tests/cuda)
    in_pool = torch.zeros(E + 1, dtype=torch.bool, device=weights.device).index_fill_(0, pool, True)
    outside = valid & ~in_pool[index]
    if not (do_fold and fold is not None):
        return _drop(weights, index, outside, E, renormalise=False)
    loss = fold.loss[:, pool]                                               # [E, D]
    target = pool[loss.argmin(dim=1)]                                       # [E]
    scale = torch.where(torch.isinf(loss.min(dim=1).values), 0.0, fold.scale.gather(1, target[:, None])[:, 0])
    src = index.clamp_max(E - 1)
    new_w = torch.where(outside, weights * scale[src], weights)
    new_i = torch.where(outside, target[src], index)
    return _merge_duplicates(*_drop(new_w, new_i, outside & (new_w == 0), E, renormalise=False), E)


def _merge_duplicates(weights, index, E: int):
    """A token whose folded route lands on an expert it already uses gets one route with the summed
    weight (the expert is linear in its gate weight), so the expert runs once for it, not twice."""
    k = index.shape[1]
    same = (index[:, :, None] == index[:, None, :]) & (index < E)[:, :, None]     # [T, k, k]
    earlier = torch.ones(k, k, dtype=torch.bool, device=index.device).tril(-1)    # slot j < slot i
    repeat = (same & earlier).any(-1)                                             # [T, k]
    summed = (same.to(weights.dtype) * weights[:, None, :]).sum(-1)               # [T, k]
    return torch.where(repeat, 0.0, summed).to(weights.dtype), torch.where(repeat, E, index)
