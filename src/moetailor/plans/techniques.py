"""Plan builders for expert folding (ExFold) and expert skipping / per-layer allocation (Faster MoE
inference). Every technique is a setting of the shared ``LayerPolicy`` (docs/plans.md lists its
fields); this module only writes policies and plans, ``routing.router.route`` applies them.

Folding keeps K_pre routes per prefill token (``fold-prefill:K``), a per-step pool of D experts by
batch importance (``fold-decode:D``) or a plan's static pool (``pool-fold:PLAN``) and folds each
excluded route onto the lowest-loss kept expert (weight S[src, dst] * g_src added); ``drop-*`` are the
same budgets without folding (excluded routes vanish, no renormalisation). Skipping lowers k
(``topk:K``), sets it per MoE layer (``layer-k``, ``bhep:B/H/E/P``) or drops routes weaker than
NAEE's per-layer beta (``skip``). Layer positions count MoE layers from 0, not decoder layers.
"""
from __future__ import annotations

import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..models.loading import load_checked, model_fingerprint
from ..routing.policy import FULL_PHASE, LayerPolicy, PhasePolicy
from .criteria import parse_json_int_list
from .plan import Plan

FOLD_CALIB_TOKENS = 32768   # tokens of the default fold calibration (same as `moetailor eval --sweep`)
FOLD_CALIB_DATA = "mix"


@dataclass(frozen=True)
class Shape:
    """What a policy builder needs to know about a model."""

    layers: tuple[int, ...]   # MoE decoder-layer indices
    num_experts: int          # m
    top_k: int                # k

    @classmethod
    def of(cls, model_or_fingerprint) -> "Shape":
        fp = model_or_fingerprint if isinstance(model_or_fingerprint, dict) else model_fingerprint(model_or_fingerprint)
        return cls(tuple(fp["moe_layers"]), int(fp["num_experts"]), int(fp["top_k"]))


def _int(value, what: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def fold_prefill(shape: Shape, k_pre: int, fold: bool = True) -> PhasePolicy:
    """Token-level folding: each token keeps its ``k_pre`` strongest routes (K_pre in [1, k])."""
    if not 1 <= k_pre <= shape.top_k:
        raise ValueError(f"K_pre={k_pre} must be in [1, {shape.top_k}] (each token keeps K_pre of the model's "
                         f"top-{shape.top_k} experts)")
    return PhasePolicy.uniform(list(shape.layers), LayerPolicy(token_keep=k_pre, fold=fold))


def fold_decode(shape: Shape, pool: int, fold: bool = True) -> PhasePolicy:
    """Batch-level folding: each step keeps a pool of ``pool`` experts (D in [1, m])."""
    if not 1 <= pool <= shape.num_experts:
        raise ValueError(f"D={pool} must be in [1, {shape.num_experts}] (the step's pool is D of the "
                         f"{shape.num_experts} routed experts)")
    return PhasePolicy.uniform(list(shape.layers), LayerPolicy(batch_pool=pool, fold=fold))


def pool_with_fold(policy: PhasePolicy, fold: bool = True) -> PhasePolicy:
    """A static pool (a plan's ``keep`` lists, e.g. from pruning) whose excluded routes fold onto
    kept experts (``fold``) or vanish (plain drop), instead of the masked router's re-routing."""
    layers = {i: replace(p, pool_mode="fold" if fold else "drop") for i, p in policy.layers.items()
              if p.keep is not None}
    if not layers:
        raise ValueError("the plan keeps no static expert pool (no `keep` lists) to fold or drop; make one with "
                         "`moetailor plan`")
    return PhasePolicy({i: layers.get(i, p) for i, p in policy.layers.items()})


def check_k(shape: Shape, k: int, where: str = "") -> int:
    at = f" ({where})" if where else ""
    if not 1 <= k <= shape.top_k:
        raise ValueError(f"k'={k}{at} must be in [1, {shape.top_k}]: a token can use at most the model's "
                         f"top-{shape.top_k} experts and at least one")
    return k


def top_k_policy(shape: Shape, k: int) -> PhasePolicy:
    """Every token uses ``k`` experts in every MoE layer (k = the model's k is the full router)."""
    check_k(shape, k)
    if k == shape.top_k:
        return FULL_PHASE
    return PhasePolicy.uniform(list(shape.layers), LayerPolicy(top_k=k))


def layer_k_policy(shape: Shape, ks: list[int]) -> PhasePolicy:
    """One active-expert count per MoE layer, in MoE-layer order."""
    if len(ks) != len(shape.layers):
        raise ValueError(f"the per-layer list has {len(ks)} entries but the model has {len(shape.layers)} MoE "
                         f"layers; give one k per MoE layer (e.g. {'/'.join([str(shape.top_k)] * len(shape.layers))})")
    for pos, k in enumerate(ks):
        check_k(shape, k, f"MoE layer {pos}")
    return PhasePolicy({i: LayerPolicy(top_k=k) for i, k in zip(shape.layers, ks) if k != shape.top_k})


def interpolate_k(num_layers: int, b: int, h: int, e: int, p: int) -> list[int]:
    """The four-tuple allocation: ``b`` at MoE layer 0, ``h`` at layer ``p``, ``e`` at the last
    layer, linear in between, rounded half up. ``p`` at an end layer needs that end's value equal h."""
    if num_layers < 1:
        raise ValueError("the model has no MoE layers to allocate experts to")
    last = num_layers - 1
    if not 0 <= p <= last:
        raise ValueError(f"p={p} is outside the MoE layers 0..{last}; the peak layer must be one of them")
    if p == 0 and b != h:
        raise ValueError(f"p=0 puts the peak on the first layer, so b ({b}) and h ({h}) must be equal")
    if p == last and e != h and last > 0:
        raise ValueError(f"p={p} puts the peak on the last layer, so e ({e}) and h ({h}) must be equal")
    out = []
    for i in range(num_layers):
        if i <= p:
            x = b + (h - b) * (i / p) if p > 0 else h
        else:
            x = h + (e - h) * ((i - p) / (last - p))
        out.append(int(math.floor(x + 0.5)))
    return out


def parse_k_list(text: str) -> list[int]:
    """'4/4/6/8', '4-4-6-8', '4,4,6,8' or '[4, 4, 6, 8]' -> [4, 4, 6, 8]."""
    text = text.strip()
    if text.startswith("["):
        return parse_json_int_list(text, "the per-layer list")
    parts = [p for p in re.split(r"[/,\- ]+", text) if p]
    if not parts:
        raise ValueError("the per-layer list is empty; write one k per MoE layer, e.g. 4/4/6/8")
    return [_int(p, f"per-layer list entry {p!r}") for p in parts]


def bhep_policy(shape: Shape, b: int, h: int, e: int, p: int) -> PhasePolicy:
    return layer_k_policy(shape, interpolate_k(len(shape.layers), b, h, e, p))


def skip_policy(shape: Shape, stats, beta: float | None = None) -> PhasePolicy:
    """NAEE-style dynamic skipping with per-layer beta from ``stats`` (an ExpertStats), or one
    ``beta`` for every layer."""
    if beta is not None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must be in [0, 1] (a ratio w_i / w_1 of gate weights)")
        return PhasePolicy.uniform(list(shape.layers), LayerPolicy(skip_beta=float(beta)))
    if stats is None:
        raise ValueError("dynamic skipping needs beta: pass a statistics file (`moetailor calibrate`) or a number")
    layers = {}
    for i in shape.layers:
        if i not in stats.layers:
            raise ValueError(f"the statistics have no MoE layer {i}; they were made for another model — rerun "
                             "`moetailor calibrate` on this model")
        b = stats.layers[i].beta
        if b is None:
            raise ValueError(f"the statistics saw no tokens in layer {i}, so beta is unknown; calibrate on more text")
        layers[i] = LayerPolicy(skip_beta=round(float(b), 6))
    return PhasePolicy(layers)


def attach_fold_tables(model, stats_path: str | Path) -> None:
    """Load ExFold tables from ``stats_path`` into the model's RoutingController (checked against the
    model), so folding policies compile everywhere the controller is used (engine, held-out KL)."""
    from ..calibration import load_fold_tables
    from ..routing import RoutingController

    ctl = RoutingController.of(model)
    path = str(stats_path)
    if ctl.fold_source != path or not ctl.fold_tables:
        ctl.set_fold_tables(load_fold_tables(path, model), source=path)


def attach_plan_fold_tables(model, plan) -> None:
    """Give ``model`` the fold tables and novice constants ``plan`` needs (its ``fold_stats``,
    ``Plan.fold_tables_path``); a no-op for a plan that neither folds nor substitutes constants.
    Every consumer of a plan (engine, eval, tune) calls this."""
    carried = getattr(model, "moetailor_constants", None)
    if plan is not None and plan.needs_constants and carried and not plan.fold_stats:
        from ..routing import RoutingController  # a novice checkpoint's own constants (models/novice.py)
        ctl = RoutingController.of(model)
        if ctl.constants_source != "checkpoint":
            ctl.set_constants(carried, source="checkpoint")
        if not plan.needs_fold_tables:
            return
    path = plan.fold_tables_path() if plan is not None else None
    if path is None:
        return
    if plan.needs_fold_tables:
        attach_fold_tables(model, path)
    if plan.needs_constants:
        attach_constants(model, path)


def attach_constants(model, stats_path: str | Path) -> None:
    """Load the novice constants (each expert's mean output, ``LayerStats.mean_output``) from
    ``stats_path`` into the model's RoutingController (checked against the model)."""
    from ..calibration import ExpertStats
    from ..routing import RoutingController

    ctl = RoutingController.of(model)
    path = str(stats_path)
    if ctl.constants_source == path and ctl.constants:
        return
    stats = ExpertStats.load(path)
    stats.check_model(model)
    stats.require_outputs("a novice plan")
    ctl.set_constants({i: l.mean_output.float() for i, l in stats.layers.items()}, source=path)


def default_stats_path(model) -> Path:
    """Where auto-calibrated fold statistics of ``model`` are cached ($MOETAILOR_CACHE or
    ~/.cache/moetailor, keyed by the router hash, so another model never picks them up)."""
    root = Path(os.environ.get("MOETAILOR_CACHE") or Path.home() / ".cache" / "moetailor")
    return root / "stats" / f"{model_fingerprint(model)['router_hash']}-fold.safetensors"


def ensure_fold_stats(model, tokenizer=None, path: str | Path | None = None, tokens: int = FOLD_CALIB_TOKENS,
                      data: str = FOLD_CALIB_DATA, log=None) -> Path:
    """A statistics file with fold tables for ``model``: ``path`` when given (must exist), else the
    cached default, calibrated once (``tokens`` of ``data``) when missing."""
    from ..calibration import ExpertStats, StatsMismatch, calibrate

    log = log or (lambda m: print(m, file=sys.stderr))
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"fold statistics {path} do not exist; create them with "
                                    f"`moetailor calibrate MODEL --fold --out {path}`")
        return path
    path = default_stats_path(model)
    if path.is_file():
        try:
            stats = ExpertStats.load(path)
            stats.check_model(model)
            if stats.has_fold:
                return path
        except (StatsMismatch, ValueError):
            pass
    if tokenizer is None:
        source = getattr(model, "moetailor_source", None)
        if source is None:
            raise ValueError("no fold statistics were given and the model has no tokenizer to calibrate with; run "
                             "`moetailor calibrate MODEL --fold --out STATS` and pass STATS (e.g. fold-decode:32@STATS)")
        from ..models.loading import load_tokenizer
        tokenizer = load_tokenizer(source)
    log(f"calibrating fold tables on {tokens:,} tokens of {data!r} (once per model) -> {path}")
    t0 = time.time()
    stats = calibrate(model, tokenizer, data, tokens, fold=True, progress=False,
                      command=f"auto: fold statistics for {getattr(model, 'moetailor_source', 'model')}")
    stats.save(path)
    log(f"calibrated fold tables in {time.time() - t0:.0f} s")
    return path


def technique_plan(model, prefill: PhasePolicy | None = None, decode: PhasePolicy | None = None,
                   stats_path: str | Path | None = None, **meta) -> Plan:
    """A plan for ``model`` with the given phase policies; ``stats_path`` is recorded as the plan's
    fold statistics (and attached to the model) when a policy needs fold tables or pool importance."""
    fp = model_fingerprint(model)
    policies = [p for p in (prefill, decode) if p is not None]
    needs = any(p.needs_fold_statistics for p in policies)
    if needs and stats_path is None:
        raise ValueError("this plan folds experts (or picks a batch pool by importance) and needs fold statistics; "
                         "run `moetailor calibrate MODEL --fold --out STATS` and pass STATS")
    if needs:
        attach_fold_tables(model, stats_path)
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S"))
    return Plan(model=fp, prefill=prefill or FULL_PHASE, decode=decode or FULL_PHASE, meta=meta,
                fold_stats=str(stats_path) if needs else None)


SPEC_HELP = ("full | fold-prefill:K | drop-prefill:K | fold-decode:D | drop-decode:D | topk:K | layer-k:K1/K2/... | "
             "bhep:B/H/E/P | skip | skip:BETA | pool-fold:PLAN | pool-drop:PLAN | plan:PLAN (its own policy "
             "for this phase)")


def policy_from_spec(model, spec: str, stats=None, phase: str = "decode") -> PhasePolicy:
    """A phase policy from a short spec (see ``SPEC_HELP``). ``stats`` (a path or ExpertStats) gives
    NAEE beta for ``skip``; fold tables are attached separately (``technique_plan``)."""
    shape = Shape.of(model)
    name, _, arg = spec.strip().partition(":")
    arg = arg.strip()

    def need_arg(example: str) -> str:
        if not arg:
            raise ValueError(f"policy {name!r} needs an argument, e.g. {example}")
        return arg

    if name == "full":
        return FULL_PHASE
    if name in ("fold-prefill", "drop-prefill"):
        return fold_prefill(shape, _int(need_arg(f"{name}:4"), f"{name} K_pre"), fold=name.startswith("fold"))
    if name in ("fold-decode", "drop-decode"):
        return fold_decode(shape, _int(need_arg(f"{name}:32"), f"{name} D"), fold=name.startswith("fold"))
    if name == "topk":
        return top_k_policy(shape, _int(need_arg("topk:4"), "topk k'"))
    if name == "layer-k":
        return layer_k_policy(shape, parse_k_list(need_arg("layer-k:4/4/6/8")))
    if name == "bhep":
        values = parse_k_list(need_arg("bhep:2/8/4/2"))
        if len(values) != 4:
            raise ValueError(f"bhep takes four numbers B/H/E/P (first-layer k, peak k, last-layer k, peak layer), "
                             f"got {len(values)}: {arg!r}")
        return bhep_policy(shape, *values)
    if name == "skip":
        if arg:
            try:
                beta = float(arg)
            except ValueError:
                raise ValueError(f"skip:{arg} — the argument is a beta in [0, 1], e.g. skip:0.3") from None
            return skip_policy(shape, None, beta)
        from ..calibration import ExpertStats
        return skip_policy(shape, load_checked(stats, ExpertStats, model))
    if name in ("pool-fold", "pool-drop", "plan"):
        plan = load_checked(need_arg(f"{name}:plans/reap-0.5.json"), Plan, model)
        if name == "plan":
            return plan.phase(phase)
        return pool_with_fold(plan.pruning_policy(), fold=name == "pool-fold")
    raise ValueError(f"unknown policy {spec!r}; valid: {SPEC_HELP}")


def plan_from_specs(model, prefill: str | None, decode: str | None, stats_path: str | Path | None = None,
                    tokenizer=None) -> Plan:
    """The plan `generate` / `serve` run for ``--prefill-policy`` / ``--decode-policy``: fold statistics
    are taken from ``stats_path`` or calibrated once and cached (``ensure_fold_stats``) when needed."""
    pre = policy_from_spec(model, prefill, stats_path, "prefill") if prefill else None
    dec = policy_from_spec(model, decode, stats_path, "decode") if decode else None
    needs = any(p.needs_fold_statistics for p in (pre, dec) if p is not None)
    path = ensure_fold_stats(model, tokenizer, stats_path) if needs else stats_path
    return technique_plan(model, pre, dec, path if needs else None, prefill_spec=prefill, decode_spec=decode)

