"""A plan: which experts run, per layer and per phase, and where that decision came from.

JSON schema (version 1), documented in docs/plans.md::

    {"format": "moetailor-plan", "version": 1,
     "model": {model_type, moe_layers, num_experts, top_k, router_hash, source},
     "prefill": {"<layer>": LayerPolicy, ...},   # layers not listed run the full router
     "decode":  {"<layer>": LayerPolicy, ...},
     "meta": {criterion, keep_ratio, keep_experts, stats, created, command, ...},
     "fold_stats": "path/to/stats.safetensors" | null}   # needed only by folding policies

The plan is the one artifact every technique writes: pruning sets ``keep``, skipping sets
``top_k``/``skip_beta``, folding sets ``pool_mode="fold"``/``token_keep``/``batch_pool``.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..models.loading import fingerprint_mismatch, model_fingerprint, read_json
from ..routing.policy import FULL_PHASE, LayerPolicy, PhasePolicy

PLAN_FORMAT = "moetailor-plan"
PLAN_VERSION = 1
PHASES = ("prefill", "decode")


class PlanMismatch(ValueError):
    pass


@dataclass(frozen=True)
class Plan:
    model: dict
    prefill: PhasePolicy = FULL_PHASE
    decode: PhasePolicy = FULL_PHASE
    meta: dict = field(default_factory=dict)
    fold_stats: str | None = None

    def phase(self, name: str) -> PhasePolicy:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")
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
        problem = fingerprint_mismatch(self.model, model_fingerprint(model))
        if problem:
            raise PlanMismatch(f"plan does not match the model ({problem}); make the plan from statistics of this "
                               f"model (`moetailor calibrate` then `moetailor plan`)")
        for name in PHASES:
            for layer in self.model.get("moe_layers", []):
                self.phase(name).for_layer(layer).validate(self.model["num_experts"], self.model["top_k"],
                                                           where=f"{name} layer {layer}")

    def to_json(self) -> dict:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model": self.model,
                "prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
                "meta": self.meta, "fold_stats": self.fold_stats}

    @classmethod
    def from_json(cls, data: dict, where: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"{where} is not a moetailor plan (missing format={PLAN_FORMAT!r}); "
                             "create one with `moetailor plan`")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"{where} has plan version {data.get('version')}, this moetailor reads version {PLAN_VERSION}")
        missing = [k for k in ("model", "prefill", "decode") if k not in data]
        if missing:
            raise ValueError(f"{where} lacks {missing}; it may be truncated — regenerate it")
        try:
            return cls(model=data["model"], prefill=PhasePolicy.from_json(data["prefill"]),
                       decode=PhasePolicy.from_json(data["decode"]), meta=data.get("meta", {}),
                       fold_stats=data.get("fold_stats"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where} is malformed: {e}") from None

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename): a crash never leaves half a plan."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(read_json(Path(path), "plan"), where=f"plan file {path}")


def uniform_plan(model, decode: LayerPolicy | None = None, prefill: LayerPolicy | None = None, **meta) -> Plan:
    """A plan applying the same layer policy to every MoE layer of ``model`` (per phase)."""
    fp = model_fingerprint(model)
    def phase(p):
        return PhasePolicy.uniform(fp["moe_layers"], p) if p is not None else FULL_PHASE
    return Plan(model=fp, prefill=phase(prefill), decode=phase(decode), meta=dict(meta))
