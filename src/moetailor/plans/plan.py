"""A plan: which experts run, per layer and per phase, and where that decision came from.

The one artifact every technique writes (pruning sets ``keep``, skipping ``top_k``/``skip_beta``,
folding ``pool_mode="fold"``/``token_keep``/``batch_pool``); its JSON schema is in docs/plans.md.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..models.loading import fingerprint_mismatch, model_fingerprint, read_json
from ..outputs import write_json
from ..routing.policy import FULL_PHASE, LayerPolicy, PhasePolicy
from ..tables import unknown_choice

PLAN_FORMAT = "moetailor-plan"
PLAN_VERSION = 1
PHASES = ("prefill", "decode")
FINGERPRINT_KEYS = ("model_type", "moe_layers", "num_experts", "top_k", "router_hash")
REGENERATE = "regenerate it with `moetailor plan` (or `moetailor search-k`) from statistics of the model"


def check_fingerprint(model, where: str = "plan") -> None:
    """Raise a one-line ValueError unless ``model`` is a complete model fingerprint: a plan without
    one could be applied to any model unchecked."""
    if not isinstance(model, dict):
        raise ValueError(f"{where}: \"model\" must be the model fingerprint object ({', '.join(FINGERPRINT_KEYS)}), "
                         f"got {type(model).__name__}; {REGENERATE}")
    missing = [k for k in FINGERPRINT_KEYS if k not in model]
    if missing:
        raise ValueError(f"{where} has no complete model fingerprint ({', '.join(missing)} missing from \"model\"), "
                         f"so nothing checks which model it fits; {REGENERATE}")
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    layers = model["moe_layers"]
    bad = ("moe_layers" if not (isinstance(layers, list) and layers and all(is_int(i) and i >= 0 for i in layers))
           else "num_experts" if not (is_int(model["num_experts"]) and model["num_experts"] >= 1)
           else "top_k" if not (is_int(model["top_k"]) and 1 <= model["top_k"] <= model["num_experts"])
           else "model_type" if not isinstance(model["model_type"], str)
           else "router_hash" if not (isinstance(model["router_hash"], str) and model["router_hash"]) else None)
    if bad:
        raise ValueError(f"{where}: model fingerprint field {bad!r} is malformed ({model[bad]!r}"[:160] +
                         f"); {REGENERATE}")


class PlanMismatch(ValueError):
    pass


@dataclass(frozen=True)
class Plan:
    model: dict
    prefill: PhasePolicy = FULL_PHASE
    decode: PhasePolicy = FULL_PHASE
    meta: dict = field(default_factory=dict)
    fold_stats: str | None = None
    source: str | None = field(default=None, compare=False, repr=False)   # the file it was loaded from

    @property
    def needs_fold_tables(self) -> bool:
        return self.prefill.needs_fold_statistics or self.decode.needs_fold_statistics

    @property
    def merges(self) -> bool:
        """Some phase merges experts: served as the merged checkpoint `moetailor prune` writes."""
        return self.prefill.merges or self.decode.merges

    @property
    def needs_constants(self) -> bool:
        """Some phase replaces dropped experts by their constants (novice experts, read from ``fold_stats``)."""
        return self.prefill.needs_constants or self.decode.needs_constants

    def fold_tables_path(self) -> Path | None:
        """The statistics file this plan's folding or novice policies read (fold tables, novice constants),
        checked to exist; None when no policy needs one. The one place a plan's ``fold_stats`` is turned
        into a file (every verb calls it)."""
        if not (self.needs_fold_tables or self.needs_constants):
            return None
        where = f"plan {self.source}" if self.source else "the plan"
        if not self.fold_stats and not self.needs_fold_tables:
            raise ValueError(f"{where} replaces dropped experts by constants (novice experts) but names no statistics "
                             "(its \"fold_stats\" is null); remake it with `moetailor plan STATS ... --novice`")
        if not self.fold_stats:
            raise ValueError(f"{where} folds experts but names no fold statistics (its \"fold_stats\" is null); "
                             "remake it from statistics calibrated with --fold (`moetailor calibrate MODEL --fold "
                             "--out STATS`, then `moetailor plan STATS ...` records them)")
        path = Path(self.fold_stats)
        if not path.is_file():
            raise FileNotFoundError(f"{where} folds experts with the statistics {path}, which do not exist; put them "
                                    "back (a plan records them relative to its own folder when they lie inside "
                                    f"it), or recreate them with `moetailor calibrate MODEL --fold --out {path}`")
        return path

    def phase(self, name: str) -> PhasePolicy:
        if name not in PHASES:
            raise ValueError(unknown_choice("phase", name, PHASES))
        return self.prefill if name == "prefill" else self.decode

    def with_phases(self, prefill: PhasePolicy | None = None, decode: PhasePolicy | None = None) -> "Plan":
        """A copy with the given phase policies (None = full router for that phase)."""
        return replace(self, prefill=prefill or FULL_PHASE, decode=decode or FULL_PHASE)

    def pruning_policy(self) -> PhasePolicy:
        """The policy this plan prunes with: its decode policy, or its prefill policy when decode is full.
        Pruned (both phases), reverse and phase-aware serving are all built from it."""
        if not self.decode.is_identity:
            return self.decode
        if not self.prefill.is_identity:
            return self.prefill
        raise ValueError("the plan runs the full router in both phases, so pruned/reverse/phase-aware would all equal "
                         "the baseline; make a pruning plan with `moetailor plan`")

    def phase_aware(self) -> "Plan":
        """Full router for prefill, the pruning policy for decode (one worker, one KV cache)."""
        return self.with_phases(prefill=None, decode=self.pruning_policy())

    def kept_experts(self, phase: str = "decode") -> dict[int, tuple[int, ...]]:
        """Per layer, the experts a phase may use (only layers with a ``keep`` list)."""
        return {i: p.keep for i, p in self.phase(phase).layers.items() if p.keep is not None}

    def check_model(self, model) -> None:
        """Raise PlanMismatch when this plan was made for another model."""
        check_fingerprint(self.model)
        problem = fingerprint_mismatch(self.model, model_fingerprint(model))
        if problem:
            raise PlanMismatch(f"plan does not match the model ({problem}); make the plan from statistics of this "
                               f"model (`moetailor calibrate` then `moetailor plan`)")
        self.validate()

    def validate(self, where: str = "plan") -> None:
        """Every phase's layer policies fit the model the plan names (layers, expert ids, k)."""
        layers = set(self.model["moe_layers"])
        for name in PHASES:
            extra = sorted(set(self.phase(name).layers) - layers)
            if extra:
                raise ValueError(f"{where}: {name} policy names layer(s) {extra[:5]}, which are not MoE layers of the "
                                 f"model ({sorted(layers)[:8]}...); {REGENERATE}")
            for layer in self.model["moe_layers"]:
                self.phase(name).for_layer(layer).validate(self.model["num_experts"], self.model["top_k"],
                                                           where=f"{where}, {name} layer {layer}")

    def to_json(self, path: str | Path | None = None) -> dict:
        """The JSON document; with ``path`` (where it is written) ``fold_stats`` is stored relative to
        that file's folder when the statistics lie inside it."""
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model": self.model,
                "prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
                "meta": self.meta, "fold_stats": _stored_fold_stats(self.fold_stats, path)}

    @classmethod
    def from_json(cls, data: dict, where: str = "plan", path: str | Path | None = None) -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"{where} is not a moetailor plan (missing format={PLAN_FORMAT!r}); "
                             "create one with `moetailor plan`")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"{where} has plan version {data.get('version')}, this moetailor reads version {PLAN_VERSION}")
        missing = [k for k in ("model", "prefill", "decode") if k not in data]
        if missing:
            raise ValueError(f"{where} lacks {missing}; it may be truncated — regenerate it")
        check_fingerprint(data["model"], where)
        if not isinstance(data.get("meta", {}), dict) or not isinstance(data.get("fold_stats"), (str, type(None))):
            raise ValueError(f"{where}: \"meta\" must be an object and \"fold_stats\" a path or null; {REGENERATE}")
        phases = {}
        for name in PHASES:
            try:
                phases[name] = PhasePolicy.from_json(data[name])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where} is malformed: {name} {e}") from None
        plan = cls(model=data["model"], meta=data.get("meta", {}),
                   fold_stats=_loaded_fold_stats(data.get("fold_stats"), path),
                   source=None if path is None else str(path), **phases)
        plan.validate(where)
        return plan

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename): a crash never leaves half a plan."""
        return write_json(path, self.to_json(path), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(read_json(Path(path), "plan"), where=f"plan file {path}", path=path)


def _stored_fold_stats(fold_stats: str | None, plan_path: str | Path | None) -> str | None:
    """``fold_stats`` as written into the plan file at ``plan_path``: relative to its folder when inside it."""
    if not fold_stats or plan_path is None:
        return fold_stats
    stats, folder = Path(fold_stats).absolute(), Path(plan_path).absolute().parent
    if folder in stats.parents:
        return stats.relative_to(folder).as_posix()
    return str(stats)


def _loaded_fold_stats(fold_stats: str | None, plan_path: str | Path | None) -> str | None:
    """The absolute path a stored ``fold_stats`` names: absolute as written; relative to the plan's
    folder; else (plans written before paths were relative to the plan) to the working directory."""
    if not fold_stats or plan_path is None or Path(fold_stats).is_absolute():
        return fold_stats
    beside = Path(plan_path).absolute().parent / fold_stats
    if beside.exists() or not Path(fold_stats).exists():
        return str(beside)
    return str(Path(fold_stats).absolute())


def _counts(values: list[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def describe_phase(plan: Plan, phase: str) -> str:
    """One phrase for what ``plan`` does in ``phase``: experts kept per layer, folding, top-k, pools,
    skipping. The one description every verb prints (demo, info, eval, prune, export)."""
    policy = plan.phase(phase)
    if policy.is_identity:
        return "full router (every expert)"
    E, k = plan.model["num_experts"], plan.model["top_k"]
    layers = [policy.for_layer(i) for i in plan.model["moe_layers"]]
    parts = []
    kept = [len(p.keep) if p.keep is not None else E for p in layers]
    if any(p.keep is not None for p in layers):
        parts.append(f"keeps {_counts(kept)} of {E} experts per layer")
        if any(p.keep is not None and p.pool_mode == "fold" for p in layers):
            parts.append("folds the excluded experts' routes onto kept ones")
        if any(p.needs_constants for p in layers):
            parts.append("replaces the excluded experts by their mean outputs (novice experts)")
        if any(p.merges for p in layers):
            parts.append("merges every expert into one of them (a merged checkpoint, `moetailor prune`)")
    else:
        parts.append(f"keeps all {E} experts")
    if any(p.top_k is not None for p in layers):
        parts.append(f"routes {_counts([p.top_k or k for p in layers])} of them per token (model top-{k})")
    if any(p.token_keep is not None for p in layers):
        verb = "folds" if all(p.fold for p in layers if p.token_keep is not None) else "drops"
        parts.append(f"{verb} each token to {_counts([p.token_keep or k for p in layers])} routes")
    if any(p.batch_pool is not None for p in layers):
        verb = "folded" if all(p.fold for p in layers if p.batch_pool is not None) else "dropped"
        parts.append(f"a per-step pool of {_counts([p.batch_pool or E for p in layers])} experts (others {verb})")
    if any(p.skip_beta is not None for p in layers):
        parts.append("skips weak routes (dynamic skipping)")
    return ", ".join(parts)


def prunes_experts(plan: Plan) -> bool:
    """Whether some phase of ``plan`` removes experts (keep lists): what `pruned`/`reverse` and
    `moetailor prune` are about; a per-layer top-k plan keeps every expert."""
    return any(p.keep is not None for name in PHASES for p in plan.phase(name).layers.values())


def uniform_plan(model, decode: LayerPolicy | None = None, prefill: LayerPolicy | None = None, **meta) -> Plan:
    """A plan applying the same layer policy to every MoE layer of ``model`` (per phase)."""
    fp = model_fingerprint(model)
    def phase(p):
        return PhasePolicy.uniform(fp["moe_layers"], p) if p is not None else FULL_PHASE
    return Plan(model=fp, prefill=phase(prefill), decode=phase(decode), meta=dict(meta))


def novice_checkpoint_plan(model):
    """The plan a novice checkpoint is served with: every layer with replaced experts keeps the others and
    replaces those (``pool_mode="novice"``) in both phases; None for any other checkpoint."""

    substituted = getattr(model, "moetailor_substituted", None)
    if not substituted:
        return None
    fp = model_fingerprint(model)
    E = fp["num_experts"]
    policy = PhasePolicy({i: LayerPolicy(keep=tuple(e for e in range(E) if e not in ids), pool_mode="novice")
                          for i, ids in sorted(substituted.items())})
    return Plan(model=fp, prefill=policy, decode=policy,
                meta={"novice_checkpoint": getattr(model, "moetailor_source", None)})


VOLATILE_PLAN_META = ("created", "command", "stats")   # provenance only (when, how, from which path)


def plan_hash(plan: Plan) -> str:
    """Content hash of what a plan makes the model do (its provenance fields excluded), plus the
    content of the fold statistics it reads."""
    data = plan.to_json()
    data["meta"] = {k: v for k, v in data["meta"].items() if k not in VOLATILE_PLAN_META}
    data["model"] = {k: v for k, v in data["model"].items() if k != "source"}   # where it was loaded from
    if plan.fold_stats and Path(plan.fold_stats).is_file():
        data["fold_stats"] = hashlib.sha256(Path(plan.fold_stats).read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
