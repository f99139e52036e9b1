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

from ..models.adapters import moe_layers, semantics_for
from ..models.architectures import arch_spec
from ..models.groups import checkpoint_problem
from ..models.loading import model_fingerprint, resolve_model_path
from ..plans.plan import Plan
from .artifacts import checkpoint_directory, copy_tokenizer, model_from_state, refuse_existing

SIDECAR = "moetailor_pruning.json"


def checkpoint_kept(plan: Plan, config, phase: str = "decode") -> dict[int, tuple[int, ...]]:
    """The kept expert ids per MoE layer that one checkpoint of ``config`` can express, or a clear error.
    Reads only the plan and the config (no weights), so a shard-by-shard pruner can call it too."""
    spec = arch_spec(config)
    sem = semantics_for(config, spec)
    E = sem.num_experts
    policy = plan.phase(phase)
    kept = {}
    for index in plan.model["moe_layers"]:
        p = policy.for_layer(index)
        extra = {k: v for k, v in p.to_json().items() if k not in ("keep",)}
        if extra:
            raise ValueError(f"{phase} layer {index} sets {sorted(extra)}, which a checkpoint cannot hold "
                             "(only `keep` with pool_mode 'mask' is a property of the weights); serve this plan "
                             "in masked mode (`moetailor generate/serve --plan`) instead")
        kept[index] = p.keep if p.keep is not None else tuple(range(E))
    counts = {len(v) for v in kept.values()}
    if counts == {E}:
        raise ValueError(f"the plan's {phase} phase prunes no experts; nothing to write (pick --phase or another plan)")
    if len(counts) > 1:
        per_layer = ", ".join(f"{i}:{len(v)}" for i, v in kept.items())
        raise ValueError(f"the plan keeps different expert counts per layer ({per_layer}); one HF config has one "
                         "expert count for all layers, so a checkpoint cannot express it. Serve the plan in masked "
                         "mode (`moetailor generate/serve --plan PLAN`: the full pool with a masked router, same "
                         "outputs), or make a uniform plan (--keep / --keep-experts)")
    for i, ids in kept.items():
        problem = checkpoint_problem(ids, sem)
        if problem:
            raise ValueError(f"layer {i} {problem}. Serve the plan in masked mode, or make a group-balanced plan "
                             "(`moetailor plan` without --groups ignore chooses kept experts per group)")
    return kept


def kept_per_layer(plan: Plan, model, phase: str = "decode") -> dict[int, tuple[int, ...]]:
    """``checkpoint_kept`` after checking the plan was made for this model."""
    plan.check_model(model)
    return checkpoint_kept(plan, model.config, phase)


def pruned_config(config, count: int):
    """The pruned checkpoint's config: a copy with the routed expert count set to ``count``. Everything
    else stays: top-k, DeepSeek's n_group and topk_group (groups keep count / n_group experts each),
    routed_scaling_factor and norm_topk_prob, shared experts and dense layers."""
    config = type(config).from_dict(config.to_dict())
    setattr(config, arch_spec(config).experts_key, count)
    if getattr(config, "_experts_implementation", None) == "moetailor":  # a RoutingController's; not stock
        config._experts_implementation = None
    return config


def _module_names(model) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def pruned_state(model, kept: dict[int, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], int]:
    """The model's state dict with routed-expert dims sliced to the kept ids; returns (state, m')."""
    names = _module_names(model)
    state = dict(model.state_dict())
    E = moe_layers(model)[0].num_experts
    for layer in moe_layers(model):
        ids = torch.tensor(kept[layer.index], dtype=torch.long)
        for module in (layer.router, layer.experts):
            prefix = names[id(module)]
            for key, tensor in list(module.state_dict().items()):
                full = f"{prefix}.{key}"
                if tensor.ndim >= 1 and tensor.shape[0] == E:
                    state[full] = tensor.index_select(0, ids).clone()
    return state, len(next(iter(kept.values())))


def _dtype_of(path: Path):
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.float32


def prune_checkpoint(model, plan: Plan | str | Path, out: str | Path, overwrite: bool = False,
                     phase: str = "decode", command: str | None = None) -> Path:
    """Write a stock checkpoint with only the plan's kept experts (``model``: a path, "reference" or a
    loaded model). Written to a temporary directory and renamed: never half a checkpoint."""
    from ..models.loading import load_model

    source = None
    if isinstance(model, (str, Path)):
        source = resolve_model_path(model)
    elif getattr(model, "moetailor_source", None):
        source = Path(model.moetailor_source)
    inputs = (source, None if isinstance(plan, Plan) else plan)
    out = refuse_existing(out, overwrite, inputs)   # before any work; never over the source checkpoint
    if isinstance(model, (str, Path)):
        model = load_model(source, dtype=_dtype_of(source))  # keep the stored dtype: sizes shrink as expected
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if getattr(model, "_moetailor_controller", None) is not None:
        raise ValueError("this model has a RoutingController installed; prune a freshly loaded model")
    kept = kept_per_layer(plan, model, phase)
    spec = arch_spec(model.config)
    original_E = spec.num_experts(model.config)
    state, count = pruned_state(model, kept)

    config = pruned_config(model.config, count)
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
