"""What moetailor's transforms record beside a checkpoint, read once when the model is loaded.

``split`` and ``distill`` write stock checkpoints plus a JSON sidecar; ``load_model`` reads the facts
later stages need (a split model's sub-experts per expert, a distilled decoder's plan) into
``model.moetailor_sidecars``, so the engine asks the model and never opens a transform's files.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPLIT_SIDECAR = "moetailor_split.json"
DISTILL_SIDECAR = "moetailor_distill.json"
DISTILL_PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class SplitSidecar:
    """A ``moetailor split`` checkpoint: each original expert is ``parts`` sub-experts."""
    parts: int
    record: dict                 # the whole sidecar (partition, shares, parent ids)


@dataclass(frozen=True)
class DistillSidecar:
    """A ``moetailor distill`` decoder: it decodes under the plan it was trained with."""
    plan: dict                   # that plan's JSON (``plans.Plan.from_json`` reads it)
    plan_file: Path              # where it was read from (for messages)
    prefill_model: str | None    # the original model the prefill (and its KV cache) should come from
    record: dict                 # the whole sidecar


@dataclass(frozen=True)
class Sidecars:
    split: SplitSidecar | None = None
    distill: DistillSidecar | None = None


NONE = Sidecars()


def sidecars_of(model) -> Sidecars:
    """What ``load_model`` read beside ``model``'s checkpoint (nothing for a model built in memory)."""
    return getattr(model, "moetailor_sidecars", NONE)
