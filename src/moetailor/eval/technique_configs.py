"""Evaluation configurations for folding and skipping (each one's ``help`` says what it runs).

Fold statistics (and skip's betas) come from, in order: ``@PATH`` after the argument
(``fold-decode:32@stats.safetensors``), the base plan's ``fold_stats``, its ``meta.stats`` (skip
only), else a fold calibration made once and cached (``plans.techniques.ensure_fold_stats``). They
load when the configuration is built, so the held-out KL (run before the engine) sees them too.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..calibration import ExpertStats
from ..models.loading import load_checked
from ..plans.techniques import (
    Shape,
    bhep_policy,
    ensure_fold_stats,
    fold_decode,
    fold_prefill,
    layer_k_policy,
    parse_k_list,
    pool_with_fold,
    skip_policy,
    technique_plan,
    top_k_policy,
)
from .configurations import configuration, int_argument


def _split(arg: str | None, example: str) -> tuple[str, str | None]:
    """'32@path' -> ('32', 'path')."""
    if not arg:
        raise ValueError(f"this configuration needs an argument, e.g. {example}")
    value, _, path = arg.partition("@")
    return value.strip(), (path.strip() or None)


def _stats(model, plan, explicit: str | None, for_skip: bool = False) -> Path:
    if explicit:
        return ensure_fold_stats(model, path=explicit)
    if plan is not None and plan.fold_stats and Path(plan.fold_stats).is_file():
        return Path(plan.fold_stats)
    if for_skip and plan is not None and plan.meta.get("stats") and Path(plan.meta["stats"]).is_file():
        return Path(plan.meta["stats"])
    return ensure_fold_stats(model)


def _plan(model, base, label: str, prefill=None, decode=None, stats=None):
    meta = {**(base.meta if base is not None else {}), "configuration": label}
    return technique_plan(model, prefill, decode, stats, **meta)


def _fold_config(kind: str, fold: bool):
    name = f"{'fold' if fold else 'drop'}-{kind}"
    arg_name = "K_pre" if kind == "prefill" else "D"
    example = f"{name}:{4 if kind == 'prefill' else 32}"

    def build(model, plan, arg):
        value, path = _split(arg, example)
        n = int_argument(value, name)
        shape = Shape.of(model)
        policy = fold_prefill(shape, n, fold) if kind == "prefill" else fold_decode(shape, n, fold)
        stats = _stats(model, plan, path) if (fold or kind == "decode") else None
        return _plan(model, plan, f"{name}:{n}", **{kind: policy}, stats=stats)

    what = "each prefill token keeps K_pre of its k routes" if kind == "prefill" else "each decode step keeps D experts"
    configuration(name, uses_plan=False, takes_arg=True,
                  help=f"{example}[@STATS] — {what}, the rest {'folded (ExFold)' if fold else 'dropped'}; "
                       f"{arg_name} is the budget")(build)


for _kind in ("prefill", "decode"):
    for _fold in (True, False):
        _fold_config(_kind, _fold)


def _pool(fold: bool):
    label = "plan+fold" if fold else "plan+drop"

    def build(model, plan, arg):
        policy = pool_with_fold(plan.pruning_policy(), fold)
        stats = _stats(model, plan, None) if fold else None
        return _plan(model, plan, label, decode=policy, stats=stats)

    configuration(label, uses_plan=True,
                  help=f"full prefill, the plan's decode pool with excluded routes "
                       f"{'folded onto kept experts (ExFold)' if fold else 'dropped (no re-routing)'}")(build)


_pool(True)
_pool(False)


def _topk(phase: str):
    def build(model, plan, arg):
        k = int_argument(arg, f"topk-{phase}")
        return _plan(model, plan, f"topk-{phase}:{k}", **{phase: top_k_policy(Shape.of(model), k)})

    configuration(f"topk-{phase}", uses_plan=False, takes_arg=True,
                  help=f"topk-{phase}:K — every token uses K experts in {phase} only")(build)


_topk("decode")
_topk("prefill")


@configuration("layer-k", uses_plan=False, takes_arg=True,
               help="layer-k:K1/K2/... — one k per MoE layer (in order), both phases")
def _layer_k(model, plan, arg):
    policy = layer_k_policy(Shape.of(model), parse_k_list(arg))
    return _plan(model, plan, f"layer-k:{arg}", prefill=policy, decode=policy)


@configuration("bhep", uses_plan=False, takes_arg=True,
               help="bhep:B/H/E/P — B experts in the first MoE layer, H at layer P, E in the last, interpolated")
def _bhep(model, plan, arg):
    values = parse_k_list(arg)
    if len(values) != 4:
        raise ValueError(f"bhep takes four numbers B/H/E/P, got {arg!r}")
    policy = bhep_policy(Shape.of(model), *values)
    return _plan(model, plan, f"bhep:{arg}", prefill=policy, decode=policy)


def _skip(phases: tuple[str, ...], name: str):
    def build(model, plan, arg):
        stats = load_checked(_stats(model, plan, None, for_skip=True), ExpertStats, model)
        policy = skip_policy(Shape.of(model), stats)
        built = _plan(model, plan, name, **{p: policy for p in phases})
        betas = {str(i): p.skip_beta for i, p in policy.layers.items()}
        return replace(built, meta={**built.meta, "skip_beta": betas})

    configuration(name, uses_plan=False,
                  help=f"NAEE dynamic skipping in {' and '.join(phases)} (per-layer beta = median w2/w1 from "
                       "calibration statistics)")(build)


_skip(("prefill", "decode"), "skip")
_skip(("decode",), "skip-decode")
