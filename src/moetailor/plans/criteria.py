"""Expert importance criteria and budget plans made from calibration statistics (docs/plans.md has
each criterion's formula).

Per layer and expert j, over the calibration tokens T_j routed to j (hard top-k membership), with g_j
the recorded gate weight and E_j(x) the expert's output (``CRITERIA``).

A layer keeps its m' highest-scoring experts (ties: the lower id); k is unchanged. ``protect_super``
keeps the model's N super experts inside the m'; ``novice`` replaces dropped experts by their mean
outputs; a grouped router keeps m'/n_group per routing group (``grouped_keep``), so the plan can
become a pruned checkpoint.
"""
from __future__ import annotations

import re
import time

import torch

from ..calibration.calibrate import calibration_record
from ..calibration.stats import ExpertStats
from ..models.groups import balanced_keep, fingerprint_semantics, per_group_counts, unreachable
from ..models.loading import model_fingerprint, source_name
from ..routing.policy import FULL_PHASE, LayerPolicy, PhasePolicy
from ..tables import unknown_choice
from .plan import Plan

CRITERIA: dict[str, str] = {
    "frequency": "|T_j|: tokens routed to expert j",
    "mass": "sum over T_j of g_j: routing mass (soft count)",
    "ean": "sum over T_j of ||E_j(x)||: expert activation norm",
    "weighted-ean": "sum over T_j of g_j ||E_j(x)||",
    "reap": "mean over T_j of g_j ||E_j(x)|| (REAP)",
    "mone": "|T_j| x output variance: squared error of replacing j by its mean output (MoNE)",
    "random": "seeded uniform random scores (baseline)",
    "structured-even": "even expert ids first, then odd (structured baseline)",
    "structured-first": "lowest expert ids first (structured baseline)",
}
NORM_CRITERIA = ("ean", "weighted-ean", "reap")   # read the experts' output norms
PLAN_PHASES = ("decode", "prefill", "both")
GROUP_MODES = ("balanced", "ignore")


def expert_scores(stats: ExpertStats, criterion: str, seed: int = 0) -> dict[int, torch.Tensor]:
    """Per MoE layer, a float64 score [E] per expert (higher = keep first)."""
    if criterion not in CRITERIA:
        raise ValueError(unknown_choice("criterion", criterion, CRITERIA))
    if criterion in NORM_CRITERIA and not stats.has_expert_norms:
        raise ValueError(f"criterion {criterion} needs expert output norms, which these statistics do not hold "
                         f"({stats.meta.get('observed', {}).get('expert_outputs', 'none')}); use frequency or mass, "
                         "or observe with an experts kernel that gives them (vLLM on CPU: moetailor_experts_kernel)")
    out = {}
    for i, layer in stats.layers.items():
        E = layer.num_experts
        ids = torch.arange(E, dtype=torch.float64)
        if criterion in ("frequency", "mass", "ean", "weighted-ean", "reap"):
            s = getattr(layer, criterion.replace("-", "_"))
        elif criterion == "mone":
            stats.require_outputs("--criterion mone")
            s = layer.frequency * layer.output_variance
        elif criterion == "random":
            s = torch.rand(E, generator=torch.Generator().manual_seed(seed * 100_003 + i), dtype=torch.float64)
        elif criterion == "structured-even":
            s = (E - ids) + E * (ids % 2 == 0)
        else:  # structured-first
            s = E - ids
        out[i] = s.double().clone()
    return out


def super_experts(stats: ExpertStats, count: int) -> dict[int, list[int]]:
    """The model's ``count`` super experts per MoE layer: the experts whose largest output magnitude
    most dominates their layer, ranked model-wide by max |E_j(x)_i| over the calibration tokens divided
    by the median of that maximum over the layer's experts (super experts, arXiv 2507.23279: a few
    experts make the extreme activation outliers; dropping one collapses quality)."""
    if count < 0:
        raise ValueError(f"--protect-super {count} must be a count >= 0")
    if count == 0:
        return {}
    stats.require_outputs("--protect-super")
    ranked = []
    for i, layer in sorted(stats.layers.items()):
        dominance = layer.out_max / layer.out_max.median().clamp_min(1e-30)
        ranked += [(-float(d), i, e) for e, d in enumerate(dominance.tolist())]
    out: dict[int, list[int]] = {}
    for _, i, e in sorted(ranked)[:count]:
        out.setdefault(i, []).append(e)
    return {i: sorted(ids) for i, ids in out.items()}


def protected_top(scores: torch.Tensor, count: int, protected: list[int], where: str) -> tuple[int, ...]:
    """``count`` experts: the ``protected`` ones, then the highest scores among the rest."""
    if len(protected) > count:
        raise ValueError(f"{where}: {len(protected)} super experts to protect but only {count} kept; lower "
                         "--protect-super or keep more experts")
    s = scores.clone()
    s[protected] = float("inf")
    return top_experts(s, count)


def top_experts(scores: torch.Tensor, count: int) -> tuple[int, ...]:
    """The ``count`` highest scores' ids, sorted (ties go to the lower id)."""
    order = torch.argsort(-scores, stable=True)
    return tuple(sorted(order[:count].tolist()))


def parse_json_int_list(text: str, what: str) -> list[int]:
    """``[4, 4, 6, 8]`` -> [4, 4, 6, 8], with an error that names ``what`` was malformed."""
    import json

    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {text!r} is not a valid JSON list ({e})") from None
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{what} must be a JSON list of integers, got {text!r}")
    return values


def parse_layer_budgets(spec: str, moe_layers: list[int]) -> dict[int, int]:
    """``0-2:48,3-5:24`` (decoder layer ranges) or a JSON list with one count per MoE layer."""
    spec = spec.strip()
    if spec.startswith("["):
        counts = parse_json_int_list(spec, "--layers")
        if len(counts) != len(moe_layers):
            raise ValueError(f"--layers lists {len(counts)} counts but the model has {len(moe_layers)} MoE layers "
                             f"({moe_layers}); give one count per MoE layer")
        return dict(zip(moe_layers, counts))
    budgets: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?:(\d+)", part)
        if not m:
            raise ValueError(f"--layers part {part!r} is not LAYER:COUNT or FIRST-LAST:COUNT "
                             "(example: 0-2:48,3-5:24), nor a JSON list of counts")
        lo, hi, count = int(m[1]), int(m[2] or m[1]), int(m[3])
        if hi < lo:
            raise ValueError(f"--layers range {part!r} runs backwards; write FIRST-LAST with FIRST <= LAST")
        for layer in range(lo, hi + 1):
            if layer not in moe_layers:
                raise ValueError(f"--layers names layer {layer}, which is not a MoE layer of this model "
                                 f"(MoE layers: {moe_layers})")
            budgets[layer] = count
    return budgets


def layer_budgets(model_fp: dict, keep: float | None = None, keep_experts: int | None = None,
                  layers: str | dict[int, int] | None = None, per_group: int | None = None) -> dict[int, int]:
    """Kept expert count per MoE layer. ``layers`` overrides the uniform budget where it names a
    layer; layers with no budget at all stay full. ``per_group`` (grouped routers, balanced plans):
    the number of groups, so a --keep ratio keeps round(ratio * group size) experts in every group."""
    E, k, moe = model_fp["num_experts"], model_fp["top_k"], list(model_fp["moe_layers"])
    if keep is not None and keep_experts is not None:
        raise ValueError("give either --keep (a ratio) or --keep-experts (a count), not both")
    if keep is None and keep_experts is None and layers is None:
        raise ValueError("give a budget: --keep RATIO, --keep-experts COUNT or --layers SPEC")
    uniform = None
    if keep is not None:
        if not 0 < keep <= 1:
            raise ValueError(f"--keep {keep} must be a ratio in (0, 1] (e.g. 0.5 keeps half the experts)")
        uniform = max(1, round(keep * E)) if not per_group else round(keep * E / per_group) * per_group
    elif keep_experts is not None:
        uniform = int(keep_experts)
    budgets = {i: uniform for i in moe} if uniform is not None else {}
    if layers is not None:
        budgets.update(parse_layer_budgets(layers, moe) if isinstance(layers, str) else dict(layers))
    for i, count in budgets.items():
        if count > E:
            raise ValueError(f"layer {i}: cannot keep {count} experts, the layer has only {E}")
        if count < k:
            raise ValueError(f"layer {i}: keeping {count} experts is fewer than top-k={k}. Pruning keeps k fixed "
                             f"(every token still routes to {k} experts, chosen among the kept ones), so keep at "
                             f"least {k}; to use fewer experts per token lower top_k instead (expert skipping)")
    return budgets


def grouped_keep(scores: dict[int, torch.Tensor], budgets: dict[int, int], sem, groups: str) -> tuple[dict, dict]:
    """Kept ids per layer for a grouped router, and the plan's ``meta.groups`` record.
    ``balanced``: the same count from every routing group, ranked by score inside each group (a pruned
    checkpoint can hold it); ``ignore``: the top experts overall (masked serving only)."""
    if groups not in GROUP_MODES:
        raise ValueError(unknown_choice("--groups", groups, GROUP_MODES))
    if groups == "balanced":
        keep = {i: balanced_keep(scores[i], n, sem, where=f"layer {i}") for i, n in budgets.items()}
    else:
        keep = {i: top_experts(scores[i], n) for i, n in budgets.items()}
    record = {"mode": groups, "n_group": sem.n_group, "topk_group": sem.topk_group,
              "per_group": {str(i): per_group_counts(ids, sem) for i, ids in sorted(keep.items())}}
    dead = {str(i): unreachable(ids, sem) for i, ids in sorted(keep.items()) if unreachable(ids, sem)}
    if dead:
        record["unreachable"] = dead
    return keep, record


def make_plan(stats: ExpertStats, model=None, criterion: str = "reap", keep: float | None = None,
              keep_experts: int | None = None, layers: str | dict[int, int] | None = None, phase: str = "decode",
              seed: int = 0, stats_path: str | None = None, command: str | None = None,
              groups: str = "balanced", protect_super: int = 0, novice: bool = False, merge: str | None = None,
              merge_router: str = "dominant") -> Plan:
    """A pruning plan: per layer, the top-m' experts by ``criterion``, in ``phase`` ("decode" by
    default: SlimWise's phase-aware pruning keeps the full pool for prefill). On a grouped router
    (DeepSeek ``n_group`` > 1) ``groups`` says how: "balanced" (default) or "ignore" (``grouped_keep``).
    ``merge`` ("hcsmoe" | "msmoe", ``plans.merging``) merges every layer's experts into m' groups
    instead of dropping the rest (``criterion`` then ranks msmoe's dominant experts)."""
    if phase not in PLAN_PHASES:
        raise ValueError(unknown_choice("phase", phase, PLAN_PHASES))
    if model is not None:
        stats.check_model(model)
    sem = fingerprint_semantics(model_fingerprint(model) if model is not None else stats.model)
    scores = expert_scores(stats, criterion, seed)
    balanced = sem is not None and groups == "balanced"
    budgets = layer_budgets(stats.model, keep, keep_experts, layers, per_group=sem.n_group if balanced else None)
    group_record = None
    protected = super_experts(stats, protect_super)
    if novice:
        stats.require_outputs("--novice")
        if not stats_path:
            raise ValueError("a novice plan reads its constants from the statistics file: give its path")
    if merge is not None and novice:
        raise ValueError("--merge and --novice are two ways to replace the dropped experts; choose one")
    if merge is not None and sem is not None:
        raise ValueError("merging is not supported on grouped routers (DeepSeek n_group > 1) yet")
    if merge is not None:
        from .merging import merge_policy_layers
        layers_policy = merge_policy_layers(merge, stats, budgets, protected, model, merge_router, scores)
        kept = {i: p.keep for i, p in layers_policy.items()}
    elif sem is not None:
        if protected:
            raise ValueError("--protect-super is not supported on grouped routers (DeepSeek n_group > 1) yet")
        kept, group_record = grouped_keep(scores, budgets, sem, groups)
    else:
        kept = {i: protected_top(scores[i], n, protected.get(i, []), f"layer {i}") for i, n in budgets.items()}
    mode = "novice" if novice else "mask"
    policy = PhasePolicy(layers_policy if merge is not None else
                         {i: LayerPolicy(keep=kept[i], pool_mode=mode) for i in sorted(budgets)})
    meta = {"criterion": criterion, "formula": CRITERIA[criterion], "keep_ratio": keep, "keep_experts": keep_experts,
            "layers": layers if isinstance(layers, str) or layers is None else {str(i): n for i, n in layers.items()},
            "budgets": {str(i): n for i, n in sorted(budgets.items())}, "phase": phase, "seed": seed,
            "stats": stats_path, "stats_data": stats.meta.get("data"), "stats_tokens": stats.meta.get("tokens"),
            "calibration": calibration_record(stats.meta),
            "gate": stats.meta.get("gate", {}).get("name"), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": command}
    if group_record is not None:
        meta["groups"] = group_record
    if protect_super:
        meta["protect_super"] = protect_super
        meta["super_experts"] = {str(i): ids for i, ids in protected.items()}
    if novice:
        meta["novice"] = True
    if merge is not None:
        from .merging import MERGE_METHODS
        meta["merge"] = {"method": merge, "how": MERGE_METHODS[merge], "router": merge_router,
                         "weights": "routing frequency within the group"}
        if merge == "hcsmoe":
            every = all(l.has_all_outputs for l in stats.layers.values())
            meta["merge"]["signature"] = ("mean output over every calibration token" if every else
                                          "mean output over the tokens routed to the expert")
    model_fp = dict(stats.model)
    if model is not None and getattr(model, "moetailor_source", None):
        model_fp["source"] = source_name(model.moetailor_source)
    return Plan(model=model_fp, prefill=policy if phase in ("prefill", "both") else FULL_PHASE,
                decode=policy if phase in ("decode", "both") else FULL_PHASE, meta=meta,
                fold_stats=stats_path if stats.has_fold or novice else None)
