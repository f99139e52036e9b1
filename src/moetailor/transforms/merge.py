"""A merged checkpoint: a stock HF checkpoint whose experts are frequency-weighted merges of groups.

For a plan whose layers merge experts (``plans.merging``), merged expert g (groups ordered by
representative id) has, after each member's neurons are permuted to the representative's (``align``,
M-SMoE's weight matching),

    W_proj(g) = sum_{e in G_g} w_e W_proj(e)          for gate, up and down projections
    router row(g) = row(rep(g))  ("dominant")  or  sum_{e in G_g} w_e row(e)  ("weighted")

and the config's expert count is the group count, so stock transformers, vLLM and llama.cpp load it.
Written one tensor at a time; ``moetailor_pruning.json`` records ``kept`` (the representatives) and
``merged`` (members and weights).
"""
from __future__ import annotations

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


def _rows(tensor: torch.Tensor, groups: Groups, rule: str) -> torch.Tensor:
    """Router rows (or DeepSeek's correction bias) [E, ...] -> [m', ...]: the representative's
    (``rule="dominant"``) or the weighted sum of the members' (``"weighted"``), in float32, stored
    in the tensor's dtype."""
    out = [tensor[ids[0]].float() if rule == "dominant" else sum(w * tensor[e].float() for e, w in zip(ids, ws))
           for ids, ws in groups]
    return torch.stack(out).to(tensor.dtype)


def align(reference: tuple[torch.Tensor, ...], member: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``member``'s (gate [I, H], up [I, H], down [H, I]) with its intermediate neurons permuted to
    match ``reference``'s (the permutation that maximises the summed inner product of each neuron's
    gate row, up row and down column: weight matching, solved exactly by the Hungarian method). An
    expert computes the same function under any permutation of its neurons; averaging two experts
    is only meaningful once their neurons correspond (M-SMoE aligns before merging)."""
    from scipy.optimize import linear_sum_assignment

    def neurons(g, u, d):
        return torch.cat([g.float(), u.float(), d.float().T], dim=1)               # [I, 3H]
    sim = neurons(*reference) @ neurons(*member).T                                 # [I, I]
    _, perm = linear_sum_assignment(sim.double().numpy(), maximize=True)
    perm = torch.as_tensor(perm)
    gate, up, down = member
    return gate[perm], up[perm], down[:, perm]


def merge_experts(members: list[tuple[torch.Tensor, ...]], weights: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    """One merged expert (gate, up, down) from its members (the representative first): each member
    aligned to the representative (``align``), then the weighted sum, in float32."""
    ref = members[0]
    aligned = [ref] + [align(ref, m) for m in members[1:]]
    return tuple(sum(w * t[j].float() for t, w in zip(aligned, weights)) for j in range(3))


def write_merged(ckpt, model, config, plan: Plan, groups: dict[int, Groups], out: Path, overwrite: bool, inputs,
                 phase: str, command: str | None, shard_bytes: int, progress: bool) -> Path:
    """The merged checkpoint of ``groups`` (see the module docstring), one layer's experts at a time."""
    from ..models.architectures import arch_spec
    from ..models.checkpoint import EXPERT_KEY, FUSED_KEY, ROUTER_KEY, ShardWriter, hub_layout, split_layer_key
    from .artifacts import checkpoint_directory, copy_tokenizer, finish_streamed, tensor_bar
    from .prune import pruned_config, write_sidecar

    router_rule = {i: plan.phase(phase).for_layer(i).merge_router for i in groups}
    _, gate_name, up_name, down_name = hub_layout(config.model_type)
    names = ckpt.keys()
    hub: dict[int, dict] = {}       # layer -> {"prefix": ..., (proj, expert): tensor name}
    fused: dict[int, dict] = {}     # layer -> {"gate_up_proj": name, "down_proj": name}
    E = arch_spec(config).num_experts(config)
    count = len(next(iter(groups.values())))
    with checkpoint_directory(out, overwrite, inputs) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        with tensor_bar(names, "merging", progress) as bar:
            for name in names:
                bar.update(1)
                split = split_layer_key(name)
                if split is None or split[0] not in groups:
                    writer.add(name, ckpt.get(name))
                    continue
                layer, rest = split
                m, f = EXPERT_KEY.match(rest), FUSED_KEY.match(rest)
                if m:                      # merged below, once every member is known
                    slot = hub.setdefault(layer, {"prefix": f"{name[: len(name) - len(rest)]}{m['moe']}.experts"})
                    slot[(m["proj"], int(m["expert"]))] = name
                elif f:
                    fused.setdefault(layer, {})[f["proj"]] = name
                elif ROUTER_KEY.match(rest):
                    writer.add(name, _rows(ckpt.get(name), groups[layer], router_rule[layer]))
                else:
                    writer.add(name, ckpt.get(name))
            for layer, slot in sorted(hub.items()):
                projs = (gate_name, up_name, down_name)
                missing = sorted({e for e in range(E) for p in projs if (p, e) not in slot})
                if missing:
                    raise ValueError(f"{ckpt.path} lacks projections of experts {missing[:8]} of layer {layer}; the "
                                     "checkpoint is incomplete")
                for g, (ids, ws) in enumerate(groups[layer]):
                    members = [tuple(ckpt.get(slot[(p, e)]) for p in projs) for e in ids]
                    for p, t, like in zip(projs, merge_experts(members, ws), members[0]):
                        writer.add(f"{slot['prefix']}.{g}.{p}.weight", t.to(like.dtype).contiguous())
            for layer, slot in sorted(fused.items()):
                if set(slot) != {"gate_up_proj", "down_proj"}:
                    raise ValueError(f"{ckpt.path} stores layer {layer}'s experts fused but lacks "
                                     f"{sorted({'gate_up_proj', 'down_proj'} - set(slot))}; the checkpoint is incomplete")
                gate_up, down = ckpt.get(slot["gate_up_proj"]), ckpt.get(slot["down_proj"])   # [E, 2I, H], [E, H, I]
                inter = gate_up.shape[1] // 2
                merged = [merge_experts([(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in ids], ws)
                          for ids, ws in groups[layer]]
                writer.add(slot["gate_up_proj"], torch.stack([torch.cat([gm, um]) for gm, um, _ in merged])
                           .to(gate_up.dtype))
                writer.add(slot["down_proj"], torch.stack([dm for _, _, dm in merged]).to(down.dtype))
        finish_streamed(ckpt, writer, pruned_config(config, count), tmp)
        copy_tokenizer(ckpt.path, tmp)
        kept = {i: tuple(ids[0] for ids, _ in g) for i, g in groups.items()}
        write_sidecar(tmp, model, plan, kept, phase, E, command, streamed=True,
                      merged={str(i): [[list(ids), list(ws)] for ids, ws in g] for i, g in sorted(groups.items())},
                      merge_router=sorted(set(router_rule.values())),
                      merge_alignment="intermediate neurons permuted to the representative's (weight matching)")
    return out

