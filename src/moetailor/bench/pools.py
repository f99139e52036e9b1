"""Decode pools to benchmark and the models that serve them.

A pool keeps ``keep`` of each layer's routed experts, run colocated (a masked router on the full
model) or disaggregated (a pruned checkpoint built in memory): the same function. Which experts are
kept does not change the bytes a step reads, only how many; the pool is a seeded random subset, the
same in every layer.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..models.adapters import moe_layers
from ..models.architectures import arch_spec
from ..models.groups import balanced_keep, group_size, is_grouped, min_per_group
from ..plans.plan import Plan, uniform_plan
from ..routing.policy import LayerPolicy


@dataclass
class Pool:
    label: str                 # "full", "mask 50%", "pruned 50%", "k'=4"
    kind: str                  # "full" | "mask" | "pruned" | "top-k"
    keep: float = 1.0
    experts: int = 0           # routed experts per layer the pool may read (m')
    top_k: int = 0             # routes per token (k or k')
    plan: Plan | None = None   # masked pools: decode phase keeps the pool, prefill runs full
    model: object = None       # pruned pools: the pruned model


def kept_ids(num_experts: int, keep: float, top_k: int, seed: int = 0, sem=None) -> tuple[int, ...]:
    """A seeded random subset of round(keep * m) experts (at least k). A grouped router (``sem``
    with n_group > 1) keeps round(keep * group size) in every group (at least the checkpoint minimum),
    so the masked pool and the pruned checkpoint compute the same function."""
    if not 0 < keep <= 1:
        raise ValueError(f"--keep {keep} must be a fraction in (0, 1], e.g. 0.75,0.5,0.25")
    g = torch.Generator().manual_seed(seed)
    if sem is not None and is_grouped(sem):
        per = max(min_per_group(sem), round(group_size(sem) * keep))
        return balanced_keep(torch.rand(num_experts, generator=g), per * sem.n_group, sem)
    m = max(top_k, round(num_experts * keep))
    return tuple(sorted(torch.randperm(num_experts, generator=g)[:m].tolist()))


def mask_plan(model, keep: float, phase: str = "decode") -> Plan:
    """A plan whose ``phase`` keeps the pool (masked router); the other phase runs the full router."""
    layer = moe_layers(model)[0]
    policy = LayerPolicy(keep=kept_ids(layer.num_experts, keep, layer.top_k, sem=layer.semantics))
    return uniform_plan(model, **{phase: policy}, benchmark_keep=keep)


def pruned_model(model, keep: float):
    """The model with only the pool's experts (a pruned checkpoint, built in memory, never written).
    Non-expert tensors are shared with ``model``; expert tensors are sliced copies."""
    from transformers import AutoModelForCausalLM

    from ..transforms.prune import pruned_state

    layers = moe_layers(model)
    ids = kept_ids(layers[0].num_experts, keep, layers[0].top_k, sem=layers[0].semantics)
    state, m = pruned_state(model, {l.index: ids for l in layers})
    config = copy.deepcopy(model.config)
    setattr(config, arch_spec(config).experts_key, m)
    with torch.device("meta"):
        pruned = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    pruned.load_state_dict(state, assign=True, strict=True)
    # non-persistent buffers (rotary frequencies) are not in the state dict: take the original's
    originals = dict(model.named_buffers())
    for name, buf in list(pruned.named_buffers()):
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            pruned.get_submodule(owner).register_buffer(attr, originals[name], persistent=False)
    pruned.generation_config = copy.deepcopy(getattr(model, "generation_config", None))
    pruned.eval()
    pruned.moetailor_source = f"{getattr(model, 'moetailor_source', 'model')} pruned to {m} experts"
    return pruned


def make_pools(model, keeps: list[float], pruned: bool, top_ks: list[int] = ()) -> list[Pool]:
    layer = moe_layers(model)[0]
    m, k = layer.num_experts, layer.top_k
    pools = [Pool("full", "full", 1.0, m, k)]
    for keep in keeps:
        n = len(kept_ids(m, keep, k, sem=layer.semantics))
        pools.append(Pool(f"mask {keep:.0%}", "mask", keep, n, k, plan=mask_plan(model, keep)))
        if pruned:
            pools.append(Pool(f"pruned {keep:.0%}", "pruned", keep, n, k, model=pruned_model(model, keep)))
    for k2 in top_ks:
        if not 1 <= k2 <= k:
            raise ValueError(f"--top-k {k2} must be in [1, {k}] (the model's k)")
        pools.append(Pool(f"k'={k2}", "top-k", 1.0, m, k2))
    return pools


def plan_pool(model, path: str) -> Pool:
    """A decode pool from a plan file (any policy: masking, folding, skipping), labelled by file name.
    This is the hook for comparing, e.g., a folding plan's step cost with a masking plan's."""
    from pathlib import Path

    plan = Plan.load(path)
    layer = moe_layers(model)[0]
    keeps = [p.keep for p in plan.decode.layers.values() if p.keep is not None]
    ks = [p.top_k for p in plan.decode.layers.values() if p.top_k is not None]
    experts = round(sum(len(k) for k in keeps) / len(keeps)) if keeps else layer.num_experts
    top_k = min(ks) if ks else layer.top_k
    return Pool(f"plan {Path(path).stem}", "plan", experts / layer.num_experts, experts, min(top_k, experts), plan=plan)
