"""Novice checkpoints: the format stock vLLM (>= 0.34, ``fused_moe/expert_substitution.py``) loads.

A MoNE-pruned checkpoint keeps the router and the expert count, lists the replaced experts per layer
in ``config.approximate_experts`` (``{"3": [5, 9]}``), stores no weights for them but one constant
each, ``<experts prefix>.<id>.approx_value`` [H]; a replaced expert's route adds g * c_e (no
renormalisation). That is ``pool_mode="novice"``, so ``load_model`` reads it into the full-size model
(replaced rows zero, never read) with the plan and constants that serve it
(``plans.plan.novice_checkpoint_plan``, ``model.moetailor_constants``).
"""
from __future__ import annotations

import re

import torch

APPROX_SUFFIX = ".approx_value"
APPROX_KEY = re.compile(r"^(?P<moe>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.approx_value$")


def substituted_experts(config) -> dict[int, tuple[int, ...]]:
    """Per decoder layer, the experts ``config.approximate_experts`` replaces by constants ({} if none)."""
    raw = getattr(config, "approximate_experts", None)
    if raw is None:
        return {}
    try:
        out = {int(layer): tuple(sorted(int(e) for e in ids)) for layer, ids in raw.items()}
    except (AttributeError, TypeError, ValueError):   # not a dict of lists of ids
        raise ValueError("config.json's approximate_experts must map layer indices to lists of expert ids; "
                         "restore the checkpoint's config.json") from None
    return {i: ids for i, ids in out.items() if ids}


def approx_name(experts_prefix: str, expert: int) -> str:
    """``model.layers.3.mlp.experts`` + 5 -> ``model.layers.3.mlp.experts.5.approx_value``."""
    return f"{experts_prefix}.{expert}{APPROX_SUFFIX}"


def read_constants(ckpt, config, substituted: dict[int, tuple[int, ...]]) -> dict[int, torch.Tensor]:
    """Per MoE layer, [E, H] fp32 constants: the ``approx_value`` rows of the replaced experts, zeros
    for the retained ones (never used: their routes run the expert). A one-line error names a missing one."""
    from .architectures import arch_spec, split_layer_key

    E = arch_spec(config).num_experts(config)
    found: dict[tuple[int, int], str] = {}
    for name in ckpt.keys():
        split = split_layer_key(name)
        m = APPROX_KEY.match(split[1]) if split else None
        if m:
            found[(split[0], int(m["expert"]))] = name
    out = {}
    for layer, ids in substituted.items():
        missing = [e for e in ids if (layer, e) not in found]
        if missing:
            raise ValueError(f"{ckpt.path} lists experts {missing[:8]} of layer {layer} in approximate_experts but "
                             "stores no approx_value for them; the checkpoint is incomplete — write it again with "
                             "`moetailor prune`")
        rows = torch.stack([ckpt.get(found[(layer, e)]).float().reshape(-1) for e in ids])   # [n, H]
        out[layer] = torch.zeros(E, rows.shape[1]).index_copy_(0, torch.tensor(ids), rows)  # [E, H]
    return out
