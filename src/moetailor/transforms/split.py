"""MoE-Prism sub-expert splitting: each expert of width I becomes N experts of width I/N.

An expert ``E(x) = W_down (silu(W_gate x) * (W_up x))`` is a sum over its I neurons; slicing gate/up
rows and down columns by N disjoint neuron groups gives N sub-experts whose outputs sum to the
parent's. The result is a stock MoE with N*m experts and top-(N*k): a budget of 1..N*k sub-experts.

Grouping (``partition_neurons``): neurons that fire together should share a sub-expert. With
``a_i = |silu(g_i) * u_i|`` on routed calibration tokens and C_ij the Pearson correlation of a_i, a_j,
maximise J(P) = sum over groups g, pairs i < j in g of C_ij over equal-size partitions (a greedy start,
then simulated annealing over swaps); ``method="random"`` is the seeded random baseline.

Router rows (``gate``):
* ``"exact"``: each child repeats its parent's row. Softmax gives each child p_e / N, so top-(N*k)
  selects all children of the parent's top-k with weight w_e / N each; scaling the child's down
  projection by N reproduces the original exactly (sigmoid scoring, DeepSeek-V3: the child score is
  the parent's, down scale N if top-k weights are renormalised, else 1). Below the full budget, which
  children survive is topk's tie order.
* ``"proxy"`` (training-free): child p (ordered by its share s_p of the parent's output mass,
  E|a_i| * ||W_down[:, i]||) gets ``log(N s_p)`` added to its logit. The bias-free router carries the
  constant through v, the direction with mean(h.v) = 1 and minimum variance on calibration router
  inputs (v = S^-1 mu / mu^T S^-1 mu, ridge-regularised): child row = parent row + log(N s_p) v.
  Where h.v = 1 the child weight is w_e s_p, and a down scale of 1/s_p reproduces the parent at the
  full budget while smaller budgets keep each parent's heaviest parts; ``proxy_spread`` (std of h.v)
  says how close to exact. DeepSeek-V3 tie-breaks by share in e_score_correction_bias instead.
* Grouped routers (DeepSeek ``n_group`` > 1): each routing group becomes N sub-groups, so the same
  original groups win and the full budget is exact (``models.groups.split_order``).
* ``"finetune"``: the proxy router, then its rows train against the original (``training.split_finetune``).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.adapters import MoeLayer, moe_layers
from ..models.architectures import arch_spec
from ..models.groups import chosen_groups, is_grouped, split_order
from ..models.loading import model_fingerprint, read_split_sidecar  # noqa: F401 (re-exported: the split record)
from ..models.sidecars import SPLIT_SIDECAR
from ..tables import unknown_choice
from .artifacts import checkpoint_directory, checkpoint_source, copy_tokenizer, model_from_state, refuse_existing

SIDECAR = SPLIT_SIDECAR
METHODS = ("anneal", "random")
GATES = ("exact", "proxy", "finetune")
WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")   # first one present is the expert width


@dataclass
class LayerProfile:
    """Per-layer sums over routed calibration tokens (float64 for stable correlations)."""

    count: torch.Tensor        # [E] routed tokens per expert
    sum_a: torch.Tensor        # [E, I] sum of |silu(g) * u| per neuron
    sum_aa: torch.Tensor       # [E, I, I] sum of a_i a_j
    hidden_sum: torch.Tensor   # [H] router inputs (all tokens), for the proxy's constant direction
    hidden_outer: torch.Tensor  # [H, H]
    tokens: int = 0

    def mean_abs(self) -> torch.Tensor:
        return self.sum_a / self.count.clamp_min(1)[:, None]                       # [E, I]

    def correlation(self) -> torch.Tensor:
        """Pearson correlation of neuron magnitudes per expert [E, I, I]; 0 for unseen experts."""
        n = self.count.clamp_min(1)[:, None, None]
        mean = self.sum_a[:, :, None] / n                                          # [E, I, 1]
        cov = self.sum_aa / n - mean * mean.transpose(1, 2)                        # [E, I, I]
        std = cov.diagonal(dim1=1, dim2=2).clamp_min(1e-12).sqrt()                  # [E, I]
        corr = cov / (std[:, :, None] * std[:, None, :])
        return torch.where(self.count[:, None, None] > 1, corr, torch.zeros_like(corr))


def _gate_up(layer: MoeLayer, expert: int, hidden: torch.Tensor) -> torch.Tensor:
    """|silu(gate) * up| of one expert's neurons for rows of hidden [n, H] -> [n, I]."""
    gate, up = F.linear(hidden, layer.experts.gate_up_proj[expert]).chunk(2, dim=-1)
    return (layer.experts.act_fn(gate) * up).abs()


def expert_width(model) -> int:
    return int(moe_layers(model)[0].experts.down_proj.shape[-1])


@torch.no_grad()
def profile_neurons(model, batches, progress: bool = True) -> dict[int, LayerProfile]:
    """Run ``batches`` (LongTensor [B, S] token ids) through the model and collect, per MoE layer
    and expert, neuron-magnitude sums over the tokens routed to that expert."""
    from tqdm import tqdm

    from ..routing import RoutingController

    ctl = RoutingController.of(model)
    layers = {l.index: l for l in ctl.layers}
    first = next(iter(layers.values()))
    E, I = first.num_experts, int(first.experts.down_proj.shape[-1])
    H = first.experts.gate_up_proj.shape[-1]

    def zeros(*shape, layer):   # the sums live beside their layer (a model spread over GPUs: per layer)
        return torch.zeros(*shape, dtype=torch.float64, device=layer.router.weight.device)

    prof = {i: LayerProfile(zeros(E, layer=l), zeros(E, I, layer=l), zeros(E, I, I, layer=l), zeros(H, layer=l),
                            zeros(H, H, layer=l)) for i, l in layers.items()}

    def observe(layer: MoeLayer, hidden, logits, weights, index):
        p = prof[layer.index]
        h64 = hidden.double()                                                      # [T, H]
        p.hidden_sum += h64.sum(0)
        p.hidden_outer += h64.T @ h64
        p.tokens += hidden.shape[0]
        for e in torch.unique(index[index < E]).tolist():
            rows = (index == e).any(dim=-1).nonzero()[:, 0]                        # tokens routed to e
            a = _gate_up(layer, e, hidden[rows]).double()                          # [n, I]
            p.count[e] += len(rows)
            p.sum_a[e] += a.sum(0)
            p.sum_aa[e] += a.T @ a

    device = next(model.parameters()).device
    with ctl.observing(observe):
        for ids in tqdm(batches, desc="profile neurons", unit="batch", disable=not progress):
            model(input_ids=ids.to(device), use_cache=False)
    return {i: LayerProfile(p.count.cpu(), p.sum_a.cpu(), p.sum_aa.cpu(), p.hidden_sum.cpu(), p.hidden_outer.cpu(),
                            p.tokens) for i, p in prof.items()}   # the partition search runs on the CPU


def check_parts(width: int, parts: int) -> None:
    if parts < 2:
        raise ValueError(f"--parts must be at least 2 (got {parts}); 1 part is the original model")
    if width % parts:
        divisors = [d for d in range(2, width + 1) if width % d == 0][:8]
        raise ValueError(f"--parts {parts} does not divide the expert width {width}; each sub-expert needs "
                         f"{width}/{parts} neurons. Choose a divisor of {width}, e.g. {divisors}")


def objective(corr: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """J per expert: sum over groups of within-group pairwise correlation (i < j).
    corr [E, I, I], groups [E, N, I/N] neuron ids -> [E]."""
    E, N, g = groups.shape
    idx = groups.reshape(E, N, g)
    sub = corr[torch.arange(E)[:, None, None, None], idx[:, :, :, None], idx[:, :, None, :]]  # [E, N, g, g]
    total = sub.sum(dim=(1, 2, 3)) - sub.diagonal(dim1=2, dim2=3).sum(dim=(1, 2))
    return total / 2


def random_partition(E: int, I: int, parts: int, seed: int = 0) -> torch.Tensor:
    """Seeded random equal split per expert -> neuron ids [E, N, I/N]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(I, generator=gen) for _ in range(E)]).view(E, parts, I // parts)


def greedy_partition(corr: torch.Tensor, mass: torch.Tensor, parts: int) -> torch.Tensor:
    """Fill groups one at a time: seed with the heaviest unassigned neuron, then add the unassigned
    neuron with the largest summed correlation to the group. corr [E, I, I], mass [E, I] -> [E, N, I/N]."""
    E, I = mass.shape
    size = I // parts
    out = torch.empty(E, parts, size, dtype=torch.long)
    for e in range(E):
        free = torch.ones(I, dtype=torch.bool)
        for p in range(parts):
            seed = int(torch.where(free, mass[e], -math.inf).argmax())
            members = [seed]
            free[seed] = False
            affinity = corr[e, seed].clone()                                        # [I]
            for _ in range(size - 1):
                j = int(torch.where(free, affinity, -math.inf).argmax())
                members.append(j)
                free[j] = False
                affinity += corr[e, j]
            out[e, p] = torch.tensor(members)
    return out


def anneal_partition(corr: torch.Tensor, groups: torch.Tensor, steps: int = 4000, t_start: float | None = None,
                     t_end: float = 1e-3, seed: int = 0, return_score: bool = False):
    """Simulated annealing over swaps, all experts in parallel; returns the best partition seen (and,
    with ``return_score``, its objective as tracked incrementally, which must equal ``objective``).

    For a swap of neuron i (group A) with j (group B) the change of J is
    S[i,B] + S[j,A] - S[i,A] - S[j,B] + C_ii + C_jj - 2 C_ij, with S[n, g] = sum_{m in g} C[n, m]."""
    E, N, size = groups.shape
    I = N * size
    corr = corr.double()
    gen = torch.Generator().manual_seed(seed)
    assign = torch.empty(E, I, dtype=torch.long)                                     # neuron -> group
    assign.scatter_(1, groups.reshape(E, I), torch.arange(N).repeat_interleave(size).expand(E, I).contiguous())
    onehot = F.one_hot(assign, N).double()                                          # [E, I, N]
    S = corr @ onehot                                                               # [E, I, N]
    if t_start is None:  # a typical |delta| so early moves are accepted about half the time
        t_start = float(corr.abs().mean()) * 2 + 1e-6
    score = objective(corr, groups).double()
    best_score, best_assign = score.clone(), assign.clone()
    ar = torch.arange(E)
    diag = corr.diagonal(dim1=1, dim2=2)                                            # [E, I]
    for step in range(steps):
        t = t_start * (t_end / t_start) ** (step / max(steps - 1, 1))
        i = torch.randint(I, (E,), generator=gen)
        j = torch.randint(I, (E,), generator=gen)
        a, b = assign[ar, i], assign[ar, j]
        delta = (S[ar, i, b] + S[ar, j, a] - S[ar, i, a] - S[ar, j, b]
                 + diag[ar, i] + diag[ar, j] - 2 * corr[ar, i, j])                  # [E]
        accept = (a != b) & ((delta > 0) | (torch.rand(E, generator=gen, dtype=torch.float64)
                                            < torch.exp((delta / t).clamp(max=0))))
        if accept.any():
            e = ar[accept]
            ci, cj = corr[e, :, i[accept]], corr[e, :, j[accept]]                   # [e, I]
            S[e, :, a[accept]] += cj - ci
            S[e, :, b[accept]] += ci - cj
            assign[e, i[accept]], assign[e, j[accept]] = b[accept], a[accept]
            score = score + torch.where(accept, delta, 0.0)
            better = score > best_score + 1e-12
            best_score = torch.where(better, score, best_score)
            best_assign[better] = assign[better]
    best = torch.stack([torch.stack([(best_assign[e] == p).nonzero()[:, 0] for p in range(N)]) for e in range(E)])
    return (best, best_score) if return_score else best


def partition_neurons(profile: LayerProfile, parts: int, method: str = "anneal", steps: int = 4000,
                      seed: int = 0) -> torch.Tensor:
    """Neuron ids per sub-expert [E, N, I/N] (see the module docstring for the objective)."""
    E, I = profile.sum_a.shape
    check_parts(I, parts)
    if method == "random":
        return random_partition(E, I, parts, seed)
    if method != "anneal":
        raise ValueError(unknown_choice("--method", method, METHODS))
    corr = profile.correlation()
    return anneal_partition(corr, greedy_partition(corr, profile.mean_abs(), parts), steps=steps, seed=seed)


@dataclass
class LayerSplit:
    """How one layer's experts were split: child e*N + p holds neurons groups[e, p]."""

    groups: torch.Tensor                 # [E, N, I/N] neuron ids, parts sorted by share (heaviest first)
    shares: torch.Tensor                 # [E, N] share of the parent's output mass, rows sum to 1
    direction: torch.Tensor | None = None  # [H] proxy constant direction v (softmax routers)
    spread: float | None = None          # std / mean of h.v on calibration inputs


@dataclass
class SplitResult:
    model: torch.nn.Module
    layers: dict[int, LayerSplit]
    parts: int
    gate: str
    method: str
    meta: dict = field(default_factory=dict)


def output_shares(layer: MoeLayer, profile: LayerProfile, groups: torch.Tensor) -> torch.Tensor:
    """Each part's share of its parent's output mass [E, N]; neuron mass = E|a_i| * ||W_down[:, i]||."""
    col_norm = layer.experts.down_proj.detach().double().norm(dim=1)               # [E, I]
    mass = profile.mean_abs() * col_norm                                            # [E, I]
    part = mass.gather(1, groups.reshape(groups.shape[0], -1)).view(groups.shape).sum(-1)  # [E, N]
    unseen = part.sum(-1, keepdim=True) <= 0
    part = torch.where(unseen, torch.ones_like(part), part)
    return part / part.sum(-1, keepdim=True)


def constant_direction(profile: LayerProfile, ridge: float = 1e-3) -> tuple[torch.Tensor, float]:
    """v with mean(h.v) = 1 and minimum variance over calibration router inputs; (v [H], std/mean)."""
    n = max(profile.tokens, 1)
    mu = profile.hidden_sum / n                                                     # [H]
    cov = profile.hidden_outer / n - torch.outer(mu, mu)                            # [H, H]
    cov = cov + ridge * cov.diagonal().mean().clamp_min(1e-12) * torch.eye(len(mu), dtype=cov.dtype)
    x = torch.linalg.solve(cov, mu)
    v = x / (mu @ x)
    spread = float((v @ cov @ v).clamp_min(0).sqrt())                               # std of h.v (mean 1)
    return v, spread


def plan_split(model, profile: dict[int, LayerProfile], parts: int, method: str = "anneal", gate: str = "proxy",
               steps: int = 4000, seed: int = 0) -> dict[int, LayerSplit]:
    """Partition every layer's experts and work out shares (and the proxy direction)."""
    if gate not in GATES:
        raise ValueError(unknown_choice("--gate", gate, GATES))
    out = {}
    for layer in moe_layers(model):
        p = profile[layer.index]
        groups = partition_neurons(p, parts, method, steps=steps, seed=seed + layer.index)
        shares = output_shares(layer, p, groups)
        order = shares.argsort(dim=1, descending=True)                              # heaviest part first
        groups = groups.gather(1, order[:, :, None].expand_as(groups))
        shares = shares.gather(1, order)
        direction = spread = None
        if gate != "exact" and layer.semantics.scoring == "softmax":
            direction, spread = constant_direction(p)
        out[layer.index] = LayerSplit(groups, shares, direction, spread)
    return out


def _check_splittable(model, parts: int) -> None:
    check_parts(expert_width(model), parts)
    if getattr(getattr(getattr(model, "model", model), "layers", [None])[0], "mlp", None) is None:
        raise ValueError("model has no .mlp blocks to split")


def _width_key(config, width: int) -> str:
    for key in WIDTH_KEYS:
        if getattr(config, key, None) == width:
            return key
    raise ValueError(f"cannot find the expert width {width} in the config (looked at {WIDTH_KEYS})")


@torch.no_grad()
def split_model(model, splits: dict[int, LayerSplit], parts: int, gate: str = "proxy"):
    """A new stock model of the same architecture with N*m experts of width I/N and top-(N*k)."""
    _check_splittable(model, parts)
    spec = arch_spec(model.config)
    layers = moe_layers(model)
    E, k, I = layers[0].num_experts, layers[0].top_k, expert_width(model)
    sem = layers[0].semantics
    names = {id(m): n for n, m in model.named_modules()}

    config = type(model.config).from_dict(model.config.to_dict())
    setattr(config, spec.experts_key, E * parts)
    config.num_experts_per_tok = k * parts
    setattr(config, _width_key(model.config, I), I // parts)
    if spec.model_type == "deepseek_v3":  # shared experts are n_shared_experts x the moe width: keep them whole
        config.n_shared_experts = int(config.n_shared_experts) * parts
    order = split_order(sem, parts)                                                 # [E*N] parent-major child at id c
    if is_grouped(sem):  # N sub-groups per routing group (models/groups.py: split_order)
        config.n_group, config.topk_group = sem.n_group * parts, sem.topk_group * parts
    if getattr(config, "_experts_implementation", None) == "moetailor":  # a RoutingController's; not stock
        config._experts_implementation = None

    state = dict(model.state_dict())
    for layer in layers:
        sp = splits[layer.index]
        groups, shares = sp.groups, sp.shares.float()                               # [E, N, g], [E, N]
        gu = layer.experts.gate_up_proj.detach()                                    # [E, 2I, H]
        down = layer.experts.down_proj.detach()                                     # [E, H, I]
        child = groups.reshape(E * parts, I // parts)                               # [E*N, g]
        parent = torch.arange(E).repeat_interleave(parts)                           # [E*N]
        rows = torch.cat([child, child + I], dim=1)                                 # gate rows then up rows
        new_gu = gu[parent[:, None], rows]                                          # [E*N, 2g, H]
        new_down = down[parent[:, None, None], torch.arange(down.shape[1])[None, :, None], child[:, None, :]]  # [E*N, H, g]
        scale = _down_scale(sem, gate, shares, parts).reshape(E * parts)           # [E*N]
        new_down = new_down * scale[:, None, None].to(new_down.dtype)
        weight = layer.router.weight.detach()                                       # [E, H]
        new_weight = weight.repeat_interleave(parts, dim=0).clone()                 # [E*N, H]
        if gate != "exact" and sem.scoring == "softmax":
            offset = torch.log(parts * shares.double().clamp_min(1e-3)).reshape(-1)  # [E*N]
            new_weight += (offset[:, None] * sp.direction[None, :]).to(new_weight.dtype)
        prefix_e, prefix_r = names[id(layer.experts)], names[id(layer.router)]
        state[f"{prefix_e}.gate_up_proj"] = new_gu[order].contiguous()
        state[f"{prefix_e}.down_proj"] = new_down[order].contiguous()
        state[f"{prefix_r}.weight"] = new_weight[order]
        bias = layer.router_bias
        if bias is not None:
            new_bias = bias.detach().repeat_interleave(parts).clone()
            if gate != "exact":  # tie-break by share, far below any gap between parents' scores
                new_bias -= (1e-6 * torch.arange(parts, dtype=new_bias.dtype)).repeat(E)
            state[f"{prefix_r}.e_score_correction_bias"] = new_bias[order]
        for module, prefix in ((layer.experts, prefix_e), (layer.router, prefix_r)):
            for key in module.state_dict():
                if f"{prefix}.{key}" not in (f"{prefix_e}.gate_up_proj", f"{prefix_e}.down_proj",
                                             f"{prefix_r}.weight", f"{prefix_r}.e_score_correction_bias"):
                    raise ValueError(f"don't know how to split {prefix}.{key}; splitting supports fused "
                                     "gate_up_proj/down_proj experts and a weight (+ correction bias) router")

    dtype = next(model.parameters()).dtype
    return model_from_state(config, state, dtype, "split")


def _down_scale(sem, gate: str, shares: torch.Tensor, parts: int) -> torch.Tensor:
    """Factor on each child's down projection so the children's weighted sum is the parent [E, N]."""
    if sem.scoring == "softmax":
        if gate == "exact":
            return torch.full_like(shares, float(parts))   # child weight w_e / N
        return 1.0 / shares.clamp_min(1e-3)                 # child weight w_e * s_p (where h.v = 1)
    return torch.full_like(shares, float(parts) if sem.normalise else 1.0)  # sigmoid: child score = parent's


@torch.no_grad()
def group_agreement(model, split, batches) -> dict[str, float]:
    """Grouped routers: per MoE layer, the share of calibration tokens for which the split chooses all
    N sub-groups of exactly the original's chosen groups, both routers fed the original's layer input
    (1.0 by construction, ``split_order``; below 1 only where the share tie-break reorders groups
    whose scores differ by less than about 1e-6)."""
    from ..routing import RoutingController

    original, children = moe_layers(model), {l.index: l for l in moe_layers(split)}
    same: dict[int, list[int]] = {l.index: [0, 0] for l in original}

    def observe(layer: MoeLayer, hidden, logits, weights, index):
        child = children[layer.index]
        a = chosen_groups(_choice(logits, layer), layer.semantics)                       # [T, G]
        b = chosen_groups(_choice(child.router_logits(hidden), child), child.semantics)  # [T, G*N]
        b = b.view(b.shape[0], a.shape[1], -1).all(-1)                                  # every part of a group
        same[layer.index][0] += int((a == b).all(-1).sum())
        same[layer.index][1] += a.shape[0]

    installed = RoutingController.installed(model) is None
    ctl = RoutingController.of(model)
    try:
        with ctl.observing(observe):
            for batch in batches:
                getattr(model, "model", model)(input_ids=batch.to(original[0].router.weight.device), use_cache=False)
    finally:
        if installed:
            ctl.remove()
    return {str(i): s / max(n, 1) for i, (s, n) in same.items()}


def _choice(logits: torch.Tensor, layer: MoeLayer) -> torch.Tensor:
    """Selection scores of a sigmoid router [T, E]: sigmoid + correction bias."""
    scores = logits.float().sigmoid()
    return scores + layer.router_bias.float() if layer.router_bias is not None else scores


def write_split(result: SplitResult, source_model, out: str | Path, overwrite: bool = False,
                source_dir: Path | None = None, command: str | None = None) -> Path:
    """Save the split model as a stock checkpoint (temp dir + rename) with a sidecar recording the
    partition, shares and parent ids."""
    layers = moe_layers(source_model)
    with checkpoint_directory(out, overwrite, (source_dir,)) as tmp:
        result.model.save_pretrained(tmp)
        copy_tokenizer(source_dir, tmp)
        sidecar = {"format": "moetailor-split", "version": 1, "parts": result.parts, "gate": result.gate,
                   "method": result.method, "source_model": model_fingerprint(source_model),
                   "num_experts_original": layers[0].num_experts, "top_k_original": layers[0].top_k,
                   "width_original": expert_width(source_model),
                   "child_to_parent": "child e*parts + p is part p of expert e (parts sorted by share)" if
                   not is_grouped(layers[0].semantics) else "grouped router: sub-group g*parts + p holds part p "
                   "of every expert of group g; child (g*parts + p)*E/n_group + j is part p of expert g*E/n_group + j",
                   "layers": {str(i): {"groups": s.groups.tolist(), "shares": [[round(float(x), 6) for x in r]
                                                                                for r in s.shares],
                                       "proxy_spread": s.spread} for i, s in sorted(result.layers.items())},
                   "meta": result.meta, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": command}
        (tmp / SIDECAR).write_text(json.dumps(sidecar))
    return Path(out)


def split_checkpoint(model, data, parts: int, out: str | Path, *, method: str = "anneal", gate: str = "proxy",
                     tokens: int = 16384, seq_len: int = 256, steps: int = 4000, seed: int = 0,
                     overwrite: bool = False, finetune_steps: int = 60, finetune_tokens: int | None = None,
                     progress: bool = True, command: str | None = None, device="cpu",
                     finetune_router=None) -> tuple[Path, SplitResult]:
    """Profile, partition, slice (and optionally fine-tune the router), then write the checkpoint.
    ``finetune_router``: the router training ``gate="finetune"`` runs (``training.split_finetune``, which
    `moetailor split` passes; training sits above the transforms)."""
    from ..calibration.data import data_file, iter_token_batches, parse_data_spec
    from ..models.loading import load_model, load_tokenizer

    source = checkpoint_source(model)
    inputs = (source, data_file(data))
    out = refuse_existing(out, overwrite, inputs)  # before any work
    if gate not in GATES:
        raise ValueError(unknown_choice("--gate", gate, GATES))
    if gate == "finetune" and finetune_router is None:
        raise ValueError("gate='finetune' trains the split router: pass finetune_router="
                         "moetailor.training.split_finetune.finetune_router (`moetailor split --gate finetune` does)")
    if method not in METHODS:
        raise ValueError(unknown_choice("--method", method, METHODS))
    spec = parse_data_spec(data)
    tokenizer = load_tokenizer(source) if source is not None else None
    if isinstance(model, (str, Path)):
        from ..device import Placement

        model = load_model(source, placement=Placement.of(device, spread=True))   # HF forwards only
    if tokenizer is None:
        raise ValueError("splitting needs the model's tokenizer to read calibration text; pass a checkpoint path")
    _check_splittable(model, parts)
    batches = list(iter_token_batches(tokenizer, spec, tokens, batch_tokens=4 * seq_len, seq_len=seq_len, seed=seed))
    profile = profile_neurons(model, batches, progress)
    splits = plan_split(model, profile, parts, method, gate, steps=steps, seed=seed)
    split = split_model(model, splits, parts, gate)
    meta = {"data": str(spec), "tokens": tokens, "seq_len": seq_len, "anneal_steps": steps, "seed": seed}
    if method == "anneal":
        gains = {}
        for i, s in splits.items():
            corr = profile[i].correlation()
            rand = objective(corr, random_partition(corr.shape[0], corr.shape[1], parts, seed)).mean()
            gains[str(i)] = {"objective": float(objective(corr, s.groups).mean()), "random": float(rand)}
        meta["objective"] = gains
    sem = moe_layers(model)[0].semantics
    if is_grouped(sem):  # N sub-groups per routing group, each as large as the original group
        meta["groups"] = {"n_group": sem.n_group, "topk_group": sem.topk_group, "parts": parts,
                          "split_n_group": sem.n_group * parts, "split_topk_group": sem.topk_group * parts,
                          "group_choice_agreement": group_agreement(model, split, batches)}
    result = SplitResult(split, splits, parts, gate, method, meta)
    if gate == "finetune":
        ft_tokens = finetune_tokens or tokens
        ft_batches = list(iter_token_batches(tokenizer, spec, ft_tokens, batch_tokens=2 * seq_len, seq_len=seq_len,
                                             seed=seed + 1))
        meta["finetune"] = finetune_router(model, split, ft_batches, steps=finetune_steps, progress=progress)
    return write_split(result, model, out, overwrite, source, command), result
