"""A merged checkpoint: a stock HF checkpoint whose experts are frequency-weighted merges of groups.

For a plan whose layers merge experts (``pool_mode="merge"``, ``plans.merging``), merged expert g of a
layer (groups ordered by representative id) has

    W_proj(g) = sum_{e in G_g} w_e W_proj(e)          for gate, up and down projections
    router row(g) = row(rep(g))                        merge_router "dominant"
                  = sum_{e in G_g} w_e row(e)          merge_router "weighted"

and the config's expert count is m' (the group count), so stock transformers, vLLM and llama.cpp
(after `moetailor export gguf`) load it with no moetailor code. Written one tensor at a time from
the checkpoint on disk; ``moetailor_pruning.json`` records the groups (``kept`` = the
representatives, ``merged`` = members and weights).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from ..plans.plan import Plan, describe_phase

Groups = list[tuple[tuple[int, ...], tuple[float, ...]]]


def merged_groups(plan: Plan, config, phase: str = "decode") -> dict[int, Groups] | None:
    """Per MoE layer, the merged experts a plan's ``phase`` writes (members, weights), or None when the
    phase merges nothing. One checkpoint has one expert count, so every MoE layer must merge to it."""
    from ..models.architectures import arch_spec

    policy = plan.phase(phase)
    layers = {i: policy.for_layer(i) for i in plan.model["moe_layers"]}
    if not any(p.merges for p in layers.values()):
        return None
    E = arch_spec(config).num_experts(config)
    out = {}
    for i, p in layers.items():
        if not p.merges:
            raise ValueError(f"the plan's {phase} phase {describe_phase(plan, phase)}, but layer {i} does not merge; a "
                             "merged checkpoint merges every MoE layer (make the plan with `moetailor plan STATS "
                             "--merge hcsmoe|msmoe --keep R`)")
        if sorted(e for g in p.merge for e, _ in g) != list(range(E)):
            raise ValueError(f"the plan's {phase} layer {i} does not place each of the {E} experts in one merge group; "
                             "remake it with `moetailor plan --merge`")
        out[i] = p.merge_groups()
    counts = {len(g) for g in out.values()}
    if len(counts) > 1:
        raise ValueError(f"the plan merges to different expert counts per layer ({sorted(counts)}), and one HF config "
                         "has one expert count; make a uniform plan (--keep / --keep-experts)")
    return out


def _combine(tensor: torch.Tensor, groups: Groups, rows: str = "weighted") -> torch.Tensor:
    """[E, ...] -> [m', ...]: per group the weighted sum of its members' slices (``rows="dominant"``:
    the representative's slice), computed in float32 and stored in the tensor's dtype."""
    out = []
    for ids, ws in groups:
        if rows == "dominant":
            out.append(tensor[ids[0]].float())
        else:
            out.append(sum(w * tensor[e].float() for e, w in zip(ids, ws)))
    return torch.stack(out).to(tensor.dtype)


def write_merged(ckpt, model, config, plan: Plan, groups: dict[int, Groups], out: Path, overwrite: bool, inputs,
                 phase: str, command: str | None, shard_bytes: int, progress: bool) -> Path:
    """The merged checkpoint of ``groups`` (see the module docstring), one tensor at a time."""
    from tqdm import tqdm

    from ..models.checkpoint import EXPERT_KEY, FUSED_KEY, ROUTER_KEY, ShardWriter, split_layer_key
    from ..models.architectures import arch_spec
    from .artifacts import COPIED, checkpoint_directory, copy_tokenizer
    from .prune import pruned_config, write_sidecar

    router_rule = {i: plan.phase(phase).for_layer(i).merge_router for i in groups}
    names = ckpt.keys()
    experts: dict[tuple[int, str], dict] = {}      # (layer, proj) -> {"prefix": ..., "names": {expert: name}}
    E = arch_spec(config).num_experts(config)
    count = len(next(iter(groups.values())))
    with checkpoint_directory(out, overwrite, inputs) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        with tqdm(total=len(names), unit="tensor", desc="merging", disable=not progress, file=sys.stderr,
                  mininterval=2) as bar:
            for name in names:
                bar.update(1)
                split = split_layer_key(name)
                if split is None or split[0] not in groups:
                    writer.add(name, ckpt.get(name))
                    continue
                layer, rest = split
                m = EXPERT_KEY.match(rest)
                if m:                      # merged below, once every member is known
                    base = name[: len(name) - len(rest)]
                    slot = experts.setdefault((layer, m["proj"]), {"prefix": f"{base}{m['moe']}.experts", "names": {}})
                    slot["names"][int(m["expert"])] = name
                    continue
                if FUSED_KEY.match(rest):
                    writer.add(name, _combine(ckpt.get(name), groups[layer]))
                elif ROUTER_KEY.match(rest):
                    writer.add(name, _combine(ckpt.get(name), groups[layer], router_rule[layer]))
                else:
                    writer.add(name, ckpt.get(name))
            for (layer, proj), slot in sorted(experts.items()):
                missing = sorted(set(range(E)) - set(slot["names"]))
                if missing:
                    raise ValueError(f"{ckpt.path} stores no {proj} for experts {missing[:8]} of layer {layer}; the "
                                     "checkpoint is incomplete")
                for g, (ids, ws) in enumerate(groups[layer]):
                    merged = sum(w * ckpt.get(slot["names"][e]).float() for e, w in zip(ids, ws))
                    dtype = ckpt.get(slot["names"][ids[0]]).dtype
                    writer.add(f"{slot['prefix']}.{g}.{proj}.weight", merged.to(dtype).contiguous())
            writer.close()
        ckpt.close()
        merged_config = pruned_config(config, count)
        merged_config.save_pretrained(tmp)
        for extra in COPIED:
            if (ckpt.path / extra).is_file():
                shutil.copy2(ckpt.path / extra, tmp / extra)
        copy_tokenizer(ckpt.path, tmp)
        kept = {i: tuple(ids[0] for ids, _ in g) for i, g in groups.items()}
        write_sidecar(tmp, model, plan, kept, phase, E, command, streamed=True,
                      merged={str(i): [[list(ids), list(ws)] for ids, ws in g] for i, g in sorted(groups.items())},
                      merge_router=sorted(set(router_rule.values())))
    return out

