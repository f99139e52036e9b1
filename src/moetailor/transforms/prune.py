"""A pruned checkpoint: a stock HF checkpoint holding only a plan's kept experts.

Router rows, fused expert tensors and DeepSeek's ``e_score_correction_bias`` are sliced to the kept
ids and the config's expert count is set to the kept count, so stock transformers (or vLLM) loads it
without moetailor. It computes the same function as the full model with a masked router (dropped
experts' logits -inf before softmax/top-k, k unchanged). The kept original ids are recorded in
``moetailor_pruning.json`` beside the weights.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..models.adapters import moe_layers
from ..models.architectures import arch_spec
from ..models.checkpoint import EXPERT_KEY, FUSED_KEY, ROUTER_KEY, split_layer_key
from ..models.loading import model_fingerprint, resolve_model_path
from ..plans.plan import Plan
from .artifacts import checkpoint_directory, copy_tokenizer, model_from_state, refuse_existing

SIDECAR = "moetailor_pruning.json"


def kept_per_layer(plan: Plan, model, phase: str = "decode") -> dict[int, tuple[int, ...]]:
    """The kept expert ids per MoE layer that a checkpoint can express, or a clear error."""
    plan.check_model(model)
    layers = moe_layers(model)
    policy = plan.phase(phase)
    E = layers[0].num_experts
    kept = {}
    for layer in layers:
        p = policy.for_layer(layer.index)
        extra = {k: v for k, v in p.to_json().items() if k not in ("keep",)}
        if extra:
            raise ValueError(f"{phase} layer {layer.index} sets {sorted(extra)}, which a checkpoint cannot hold "
                             "(only `keep` with pool_mode 'mask' is a property of the weights); serve this plan "
                             "in masked mode (`moetailor generate/serve --plan`) instead")
        kept[layer.index] = p.keep if p.keep is not None else tuple(range(E))
    counts = {len(v) for v in kept.values()}
    if counts == {E}:
        raise ValueError(f"the plan's {phase} phase prunes no experts; nothing to write (pick --phase or another plan)")
    if len(counts) > 1:
        per_layer = ", ".join(f"{i}:{len(v)}" for i, v in kept.items())
        raise ValueError(f"the plan keeps different expert counts per layer ({per_layer}); one HF config has one "
                         "expert count for all layers, so a checkpoint cannot express it. Serve the plan in masked "
                         "mode (`moetailor generate/serve --plan PLAN`: the full pool with a masked router, same "
                         "outputs), or make a uniform plan (--keep / --keep-experts)")
    sem = layers[0].semantics
    if sem.n_group > 1:
        size = E // sem.n_group
        for i, ids in kept.items():
            per_group = [sum(1 for e in ids if e // size == g) for g in range(sem.n_group)]
            if len(set(per_group)) > 1 or per_group[0] < 2:
                raise ValueError(f"layer {i} keeps {per_group} experts in DeepSeek's {sem.n_group} routing groups; a "
                                 "pruned checkpoint needs the same count (at least 2) in every group to route "
                                 "identically. Serve the plan in masked mode, or choose kept experts per group")
    return kept


def pruned_name(name: str, kept: dict[int, tuple[int, ...]]) -> tuple[str, torch.Tensor | None] | None:
    """How a pruned checkpoint stores tensor ``name`` (the one slicing rule of the in-memory and the
    streamed pruner, for fused and hub-layout names): None = drop it (a dropped expert's weights);
    (new name, None) = keep it whole; (name, kept ids [m']) = keep those rows (router rows,
    ``e_score_correction_bias``, fused experts [E, ...]). Hub-layout experts are renumbered 0..m'-1
    in kept order."""
    split = split_layer_key(name)
    if split is None or split[0] not in kept:
        return name, None
    layer, rest = split
    ids = kept[layer]
    m = EXPERT_KEY.match(rest)
    if m:
        e = int(m["expert"])
        if e not in ids:
            return None
        base = name[: len(name) - len(rest)]
        return f"{base}{m['moe']}.experts.{ids.index(e)}.{m['proj']}.weight", None
    if FUSED_KEY.match(rest) or ROUTER_KEY.match(rest):
        return name, torch.tensor(ids, dtype=torch.long)
    return name, None


def pruned_state(model, kept: dict[int, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], int]:
    """The model's state dict with routed-expert dims sliced to the kept ids; returns (state, m')."""
    state = {}
    for name, tensor in model.state_dict().items():
        action = pruned_name(name, kept)
        if action is None:
            continue
        new, rows = action
        state[new] = tensor if rows is None else tensor.index_select(0, rows).clone()
    return state, len(next(iter(kept.values())))


def prune_checkpoint(model, plan: Plan | str | Path, out: str | Path, overwrite: bool = False,
                     phase: str = "decode", command: str | None = None) -> Path:
    """Write a stock checkpoint with only the plan's kept experts (``model``: a path, "reference" or a
    loaded model; ``streaming.prune_checkpoint_streamed`` prunes a checkpoint on disk without loading
    it). Written to a temporary directory and renamed: never half a checkpoint."""
    from ..models.checkpoint import stored_dtype
    from ..models.loading import load_model

    source = None
    if isinstance(model, (str, Path)):
        source = resolve_model_path(model)
    elif getattr(model, "moetailor_source", None):
        source = Path(model.moetailor_source)
    inputs = (source, None if isinstance(plan, Plan) else plan)
    out = refuse_existing(out, overwrite, inputs)   # before any work; never over the source checkpoint
    if isinstance(model, (str, Path)):
        model = load_model(source, dtype=stored_dtype(source))  # keep the stored dtype: sizes shrink as expected
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if getattr(model, "_moetailor_controller", None) is not None:
        raise ValueError("this model has a RoutingController installed; prune a freshly loaded model")
    kept = kept_per_layer(plan, model, phase)
    spec = arch_spec(model.config)
    original_E = spec.num_experts(model.config)
    state, count = pruned_state(model, kept)

    config = type(model.config).from_dict(model.config.to_dict())
    setattr(config, spec.experts_key, count)
    pruned = model_from_state(config, state, next(model.parameters()).dtype, "pruned")

    with checkpoint_directory(out, overwrite, inputs) as tmp:
        pruned.save_pretrained(tmp)
        copy_tokenizer(source, tmp)
        sidecar = {"format": "moetailor-pruning", "version": 1, "phase": phase,
                   "source_model": model_fingerprint(model), "num_experts_original": original_E,
                   "num_experts_kept": count, "kept": {str(i): list(ids) for i, ids in sorted(kept.items())},
                   "plan_meta": plan.meta, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": command}
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=1))
    return out


def read_sidecar(path: str | Path) -> dict:
    """The pruning record of a pruned checkpoint directory."""
    from ..models.loading import read_json

    return read_json(Path(path) / SIDECAR, "pruning sidecar")
