"""A pruned checkpoint: a stock HF checkpoint holding only a plan's kept experts.

Router rows, fused expert tensors and DeepSeek's ``e_score_correction_bias`` are sliced to the kept
ids and the expert count set to match, so stock transformers (or vLLM) loads it. It computes what the
full model computes with a masked router (dropped logits -inf before top-k, k unchanged); the kept
original ids go to ``moetailor_pruning.json``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..models.adapters import semantics_for
from ..models.architectures import arch_spec
from ..models.checkpoint import EXPERT_KEY, FUSED_KEY, ROUTER_KEY, split_layer_key
from ..models.groups import checkpoint_problem
from ..models.loading import model_fingerprint
from ..plans.plan import Plan, describe_phase
from ..routing.controller import RoutingController
from .artifacts import checkpoint_directory, checkpoint_source, copy_tokenizer, model_from_state, refuse_existing

SIDECAR = "moetailor_pruning.json"


def checkpoint_kept(plan: Plan, config, phase: str = "decode") -> dict[int, tuple[int, ...]]:
    """The kept expert ids per MoE layer that one checkpoint of ``config`` can express, or a clear error.
    Reads only the plan and the config (no weights), so a shard-by-shard pruner can call it too."""
    spec = arch_spec(config)
    sem = semantics_for(config, spec)
    E = sem.num_experts
    policy = plan.phase(phase)
    what = describe_phase(plan, phase)
    serve = ("serve it with moetailor instead: `moetailor serve MODEL --decode-plan PLAN` (its decode policy on decode "
             "steps) or `--plan PLAN` (both phases as written)" if phase == "decode" else
             "serve it with moetailor instead: `moetailor serve MODEL --plan PLAN` (both phases as written)")
    kept = {}
    for index in plan.model["moe_layers"]:
        p = policy.for_layer(index)
        extra = {k: v for k, v in p.to_json().items() if k not in ("keep",)}
        if extra:
            folded = p.keep is not None and p.pool_mode == "fold"
            fix = ("; for a checkpoint of the same kept experts without folding, make the plan with `moetailor plan "
                   "STATS --criterion C --keep R` (or `moetailor tune ... --no-fold`)" if folded else "")
            raise ValueError(f"the plan's {phase} phase {what}: {phase} layer {index} sets {sorted(extra)}, which "
                             f"weights cannot hold (a checkpoint holds only kept experts, masked); {serve}{fix}")
        kept[index] = p.keep if p.keep is not None else tuple(range(E))
    counts = {len(v) for v in kept.values()}
    if counts == {E}:
        raise ValueError(f"the plan's {phase} phase prunes no experts ({what}); nothing to write (pick --phase or "
                         "another plan)")
    if len(counts) > 1:
        raise ValueError(f"the plan's {phase} phase {what}: different expert counts per layer, and one HF config has "
                         "one expert count for all layers, so a "
                         f"checkpoint cannot express it. Make a uniform plan (--keep / --keep-experts), or {serve} "
                         "(the full pool with a masked router: the same outputs)")
    for i, ids in kept.items():
        problem = checkpoint_problem(ids, sem)
        if problem:
            raise ValueError(f"layer {i} {problem}. Make a group-balanced plan (`moetailor plan` without --groups "
                             f"ignore chooses kept experts per group), or {serve}")
    return kept


def novice_substituted(plan: Plan, config, phase: str = "decode") -> dict[int, tuple[int, ...]] | None:
    """Per MoE layer, the experts a novice plan's ``phase`` replaces by constants (what a novice
    checkpoint lists in ``approximate_experts``, ``models/novice.py``); None for a plan that is not novice.
    A plan that mixes novice layers with other settings gets a clear error."""
    policy = plan.phase(phase)
    layers = {i: policy.for_layer(i) for i in plan.model["moe_layers"]}
    if not any(p.needs_constants for p in layers.values()):
        return None
    E = arch_spec(config).num_experts(config)
    out = {}
    for i, p in layers.items():
        extra = sorted(k for k in p.to_json() if k not in ("keep", "pool_mode"))
        if extra or (p.keep is not None and p.pool_mode != "novice"):
            raise ValueError(f"the plan's {phase} layer {i} sets {extra or ['pool_mode ' + p.pool_mode]}, which a novice "
                             "checkpoint cannot hold (it holds retained experts and the replaced ones' constants); "
                             "make every layer a novice pool (`moetailor plan STATS ... --novice`)")
        if p.keep is not None:
            out[i] = tuple(e for e in range(E) if e not in p.keep)
    return out


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

    source = checkpoint_source(model)
    inputs = (source, None if isinstance(plan, Plan) else plan)
    out = refuse_existing(out, overwrite, inputs)   # before any work; never over the source checkpoint
    if isinstance(model, (str, Path)):
        model = load_model(source, dtype=stored_dtype(source))  # keep the stored dtype: sizes shrink as expected
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if RoutingController.installed(model) is not None:
        raise ValueError("this model has a RoutingController installed; prune a freshly loaded model")
    if plan.phase(phase).merges:
        raise ValueError("a merged plan's checkpoint is written from the checkpoint on disk: use `moetailor prune "
                         "MODEL PLAN --out DIR` (transforms.streaming.prune_checkpoint_streamed)")
    if novice_substituted(plan, model.config, phase) is not None:
        raise ValueError("a novice plan's checkpoint is written from the checkpoint on disk: use `moetailor prune "
                         "MODEL PLAN --out DIR` (transforms.streaming.prune_checkpoint_streamed)")
    kept = kept_per_layer(plan, model, phase)
    original_E = arch_spec(model.config).num_experts(model.config)
    state, count = pruned_state(model, kept)
    pruned = model_from_state(pruned_config(model.config, count), state, next(model.parameters()).dtype, "pruned")
    with checkpoint_directory(out, overwrite, inputs) as tmp:
        pruned.save_pretrained(tmp)
        copy_tokenizer(source, tmp)
        write_sidecar(tmp, model, plan, kept, phase, original_E, command)
    return out


def write_sidecar(directory: Path, model, plan: Plan, kept: dict[int, tuple[int, ...]], phase: str,
                  num_experts_original: int, command: str | None, **extra) -> None:
    """The pruning record beside a pruned checkpoint's weights (kept original ids per layer)."""
    sidecar = {"format": "moetailor-pruning", "version": 1, "phase": phase,
               "source_model": model_fingerprint(model), "num_experts_original": num_experts_original,
               "num_experts_kept": len(next(iter(kept.values()))),
               "kept": {str(i): list(ids) for i, ids in sorted(kept.items())},
               "plan_meta": plan.meta, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": command, **extra}
    (Path(directory) / SIDECAR).write_text(json.dumps(sidecar, indent=1))


def read_sidecar(path: str | Path) -> dict:
    """The pruning record of a pruned checkpoint directory."""
    from ..models.loading import read_json

    return read_json(Path(path) / SIDECAR, "pruning sidecar")
