"""Pruning a checkpoint on disk one tensor at a time: memory holds one output shard, never the model.

The plan is checked against a meta-device skeleton (only the routers load, for the fingerprint); each
stored tensor is then sliced or dropped by ``prune.pruned_name``'s rule, giving the same checkpoint
``prune_checkpoint`` writes from a loaded model.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..plans.plan import Plan
from .artifacts import checkpoint_directory, copy_tokenizer, finish_streamed, refuse_existing, tensor_bar
from .prune import kept_per_layer, novice_substituted, pruned_config, pruned_name, write_sidecar


def prune_checkpoint_streamed(source: str | Path, plan: Plan | str | Path, out: str | Path, overwrite: bool = False,
                              phase: str = "decode", command: str | None = None, shard_bytes: int = 1 << 30,
                              progress: bool = True) -> Path:
    """Write a stock checkpoint holding only the plan's kept experts of the checkpoint at ``source``,
    reading and writing one tensor at a time (into a temporary directory renamed at the end)."""
    from transformers import AutoConfig

    from ..models.architectures import arch_spec
    from ..models.checkpoint import ShardWriter, skeleton, stored_dtype

    inputs = (Path(source), None if isinstance(plan, Plan) else plan)
    out = refuse_existing(out, overwrite, inputs)   # before any work; never over the source checkpoint
    model, ckpt = skeleton(source, stored_dtype(source))
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    plan.check_model(model)
    from .merge import merged_groups, write_merged
    groups = merged_groups(plan, config, phase)
    if groups is not None:
        return write_merged(ckpt, model, config, plan, groups, out, overwrite, inputs, phase, command, shard_bytes,
                            progress)
    substituted = novice_substituted(plan, config, phase)
    if substituted is not None:
        return write_novice(ckpt, model, config, plan, substituted, out, overwrite, inputs, phase, command,
                            shard_bytes, progress)
    kept = kept_per_layer(plan, model, phase)
    original_E = arch_spec(config).num_experts(config)
    config = pruned_config(config, len(next(iter(kept.values()))))
    names = ckpt.keys()
    with checkpoint_directory(out, overwrite, inputs) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        with tensor_bar(names, "pruning", progress) as bar:
            for name in names:
                action = pruned_name(name, kept)
                bar.update(1)
                if action is None:
                    continue                                # a dropped expert: never read
                new, rows = action
                tensor = ckpt.get(name)
                writer.add(new, tensor if rows is None else tensor.index_select(0, rows))
        finish_streamed(ckpt, writer, config, tmp)
        copy_tokenizer(ckpt.path, tmp)
        write_sidecar(tmp, model, plan, kept, phase, original_E, command, streamed=True)
    return out


def write_novice(ckpt, model, config, plan: Plan, substituted: dict[int, tuple[int, ...]], out: Path, overwrite: bool,
                 inputs, phase: str, command: str | None, shard_bytes: int, progress: bool) -> Path:
    """A novice checkpoint (``models/novice.py``; stock vLLM >= 0.34 loads it): the retained experts under
    their own ids, no weights for the replaced ones, their constants (the plan's statistics' mean outputs,
    fp32) as ``approx_value`` tensors, and ``config.approximate_experts``. One tensor at a time."""
    from ..calibration import ExpertStats
    from ..models.architectures import arch_spec
    from ..models.checkpoint import EXPERT_KEY, FUSED_KEY, ShardWriter, split_layer_key
    from ..models.novice import approx_name

    stats = ExpertStats.load(plan.fold_tables_path())
    stats.check_model(model)
    stats.require_outputs("a novice checkpoint")
    names = ckpt.keys()
    prefixes: dict[int, str] = {}
    with checkpoint_directory(out, overwrite, inputs) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        with tensor_bar(names, "pruning", progress) as bar:
            for name in names:
                bar.update(1)
                split = split_layer_key(name)
                if split is not None and split[0] in substituted:
                    layer, rest = split
                    if FUSED_KEY.match(rest):
                        raise ValueError(f"{ckpt.path} stores layer {layer}'s experts fused ({name}); a novice "
                                         "checkpoint names retained experts one by one (the hub layout vLLM loads): "
                                         "save the model with `save_pretrained` first, which writes that layout")
                    m = EXPERT_KEY.match(rest)
                    if m:
                        prefixes[layer] = f"{name[: len(name) - len(rest)]}{m['moe']}.experts"
                        if int(m["expert"]) in substituted[layer]:
                            continue                        # a replaced expert: never read
                writer.add(name, ckpt.get(name))
            for layer, ids in sorted(substituted.items()):
                constants = stats.layers[layer].mean_output.float()
                for e in ids:
                    writer.add(approx_name(prefixes[layer], e), constants[e].contiguous())
        config.approximate_experts = {str(i): list(ids) for i, ids in sorted(substituted.items())}
        finish_streamed(ckpt, writer, config, tmp)
        copy_tokenizer(ckpt.path, tmp)
        E = arch_spec(config).num_experts(config)
        kept = {i: tuple(e for e in range(E) if e not in ids) for i, ids in substituted.items()}
        write_sidecar(tmp, model, plan, kept, phase, E, command, streamed=True, novice=True,
                      substituted={str(i): list(ids) for i, ids in sorted(substituted.items())})
    return out


def merged_checkpoint(model_path: str | Path, plan: Plan, phase: str = "decode", log=None) -> Path:
    """The merged checkpoint of ``plan`` (``transforms.merge``) for the model at ``model_path``, written
    once and cached under $MOETAILOR_CACHE (default ~/.cache/moetailor)/merged/<router hash>-<phase>-<plan
    hash>: what `eval` decodes a merged plan on."""
    import os

    from ..models.loading import resolve_model_path
    from ..plans.plan import plan_hash

    root = Path(os.environ.get("MOETAILOR_CACHE") or Path.home() / ".cache" / "moetailor")
    out = root / "merged" / f"{plan.model['router_hash']}-{phase}-{plan_hash(plan)}"
    if (out / "config.json").is_file():
        return out
    (log or (lambda m: print(m, file=sys.stderr)))(f"writing the merged checkpoint of the plan -> {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    return prune_checkpoint_streamed(resolve_model_path(model_path), plan, out, overwrite=True, phase=phase,
                                     progress=False, command="merged checkpoint for evaluation")
