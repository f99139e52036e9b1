"""Which experts run for a token, and with what weight: the one policy every technique writes.

A ``LayerPolicy`` is plain data. Pruning, router masking, folding, top-k reduction, dynamic
skipping and per-request budgets are all settings of it; ``routing.router.route`` is the one
function that applies it. Plans (``moetailor.plans``) hold one ``PhasePolicy`` per phase.

Order of application for one layer and one token (see ``route``):
  1. pool: ``keep`` restricts the experts; ``pool_mode`` says what happens to routes outside it:
     "mask" re-routes top-k among kept experts (logits of dropped experts set to -inf before
     softmax/top-k: equals a pruned checkpoint), "drop" keeps the full router's choice and drops
     routes outside the pool, "fold" keeps the full router's choice and folds outside routes onto
     the lowest-loss pool expert (ExFold), "novice" keeps the full router's choice and replaces an
     outside expert by its constant (MoNE): the route keeps its expert id and gate weight g, and the
     experts implementation adds g * c_e instead of running the expert (``runtime.experts.novice_split``;
     c_e = the expert's mean output on calibration tokens, ``CompiledPolicy.constants``), "merge"
     merges groups of experts into one each (``merge``: per group its members and their weights;
     ``keep`` = each group's representative, whose router row the merged expert takes). A merge
     changes weights, so it is served as the checkpoint `moetailor prune` writes, not by ``route``.
  2. top-k: ``top_k`` (< model k) selects fewer experts per token (expert skipping).
  3. dynamic skipping: ranks whose weight ratio to the top expert is below ``skip_beta`` drop out
     (the rest renormalised).
  4. token-level fold: each token keeps its ``token_keep`` strongest routes and folds (or drops)
     the rest onto its kept ones.
  5. batch-level pool: the step keeps ``batch_pool`` experts by batch importance; routes outside
     it fold (or drop).
A dropped route is written as the sentinel expert id E (= number of experts) with weight 0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..tables import unknown_choice

POOL_MODES = ("mask", "drop", "fold", "novice", "merge")
MERGE_ROUTERS = ("dominant", "weighted")

MergeGroups = tuple[tuple[tuple[int, float], ...], ...]   # per merged expert: (original id, weight) per member


@dataclass(frozen=True)
class LayerPolicy:
    keep: tuple[int, ...] | None = None  # allowed experts; None = all
    pool_mode: str = "mask"
    top_k: int | None = None             # active experts per token; None = the model's k
    skip_beta: float | None = None       # NAEE-style dynamic skipping threshold on w_i / w_1
    token_keep: int | None = None        # K_pre: routes kept per token (prefill folding)
    batch_pool: int | None = None        # D: experts kept per step (decode folding)
    fold: bool = True                    # for token_keep / batch_pool: fold (True) or drop (False)
    merge: MergeGroups | None = None     # pool_mode "merge": groups of (expert id, weight), representative first
    merge_router: str | None = None      # pool_mode "merge": the merged router row, "dominant" | "weighted"

    def __post_init__(self) -> None:
        if self.pool_mode not in POOL_MODES:
            raise ValueError(unknown_choice("pool_mode", self.pool_mode, POOL_MODES))
        if self.merge is not None:
            groups = tuple(tuple((int(e), float(w)) for e, w in g) for g in self.merge)
            object.__setattr__(self, "merge", groups)
        if self.keep is not None:
            keep = tuple(sorted(int(e) for e in self.keep))
            repeated = sorted({e for e in keep if keep.count(e) > 1})
            if repeated:
                raise ValueError(f"keep lists expert(s) {repeated[:5]} more than once; each kept expert id must "
                                 "appear once")
            object.__setattr__(self, "keep", keep)

    @property
    def is_identity(self) -> bool:
        return self == FULL

    @property
    def needs_constants(self) -> bool:
        """Novice experts: the dropped experts' constant outputs (from calibration statistics)."""
        return self.keep is not None and self.pool_mode == "novice"

    @property
    def merges(self) -> bool:
        """Groups of experts become one expert each (a merged checkpoint; ``transforms.merge``)."""
        return self.pool_mode == "merge"

    @property
    def needs_fold_tables(self) -> bool:
        return (self.keep is not None and self.pool_mode == "fold") or (
            self.fold and (self.token_keep is not None or self.batch_pool is not None))

    def validate(self, num_experts: int, top_k: int, where: str = "") -> None:
        """Raise a user-facing error when this policy cannot run on a layer of the given shape."""
        at = f" ({where})" if where else ""
        if self.keep is not None:
            bad = [e for e in self.keep if not 0 <= e < num_experts]
            if bad:
                raise ValueError(f"expert ids {bad[:5]} out of range 0..{num_experts - 1}{at}")
            if self.pool_mode == "mask" and len(self.keep) < (self.top_k or top_k):
                raise ValueError(
                    f"keeping {len(self.keep)} experts is fewer than top-k={self.top_k or top_k}{at}: a masked "
                    f"router still routes each token to k experts, so keep at least k (or lower top_k explicitly)")
        if (self.pool_mode == "merge") != (self.merge is not None) or (self.merge is None) != (self.merge_router is None):
            raise ValueError(f"pool_mode \"merge\" and a \"merge\" group list go together{at}; make the plan with "
                             "`moetailor plan STATS --merge hcsmoe|msmoe`")
        if self.merge is not None:
            self._validate_merge(num_experts, at)
        if self.pool_mode == "novice" and (self.token_keep is not None or self.batch_pool is not None):
            raise ValueError(f"pool_mode \"novice\" cannot be combined with token_keep or batch_pool{at}: those "
                             "would pool the novice routes as if their experts ran; use one or the other")
        if self.top_k is not None and not 1 <= self.top_k <= top_k:
            raise ValueError(f"top_k={self.top_k} must be in [1, {top_k}] (the model's k){at}")
        if self.token_keep is not None and not 1 <= self.token_keep <= (self.top_k or top_k):
            raise ValueError(f"token_keep (K_pre)={self.token_keep} must be in [1, {self.top_k or top_k}]{at}")
        if self.batch_pool is not None and not 1 <= self.batch_pool <= num_experts:
            raise ValueError(f"batch_pool (D)={self.batch_pool} must be in [1, {num_experts}]{at}")
        if self.skip_beta is not None and not 0.0 <= self.skip_beta <= 1.0:
            raise ValueError(f"skip_beta={self.skip_beta} must be in [0, 1]{at}")

    def _validate_merge(self, num_experts: int, at: str) -> None:
        members = [e for g in self.merge for e, _ in g]
        if any(not g for g in self.merge):
            raise ValueError(f"a merge group is empty{at}")
        bad = sorted({e for e in members if not 0 <= e < num_experts})
        if bad:
            raise ValueError(f"merge groups name expert ids {bad[:5]} out of range 0..{num_experts - 1}{at}")
        twice = sorted({e for e in members if members.count(e) > 1})
        if twice:
            raise ValueError(f"merge groups list expert(s) {twice[:5]} in more than one place{at}; each expert "
                             "belongs to one group")
        if any(w < 0 for g in self.merge for _, w in g) or any(abs(sum(w for _, w in g) - 1) > 1e-4 for g in self.merge):
            raise ValueError(f"merge weights must be >= 0 and sum to 1 in every group{at}")
        if self.keep != tuple(sorted(g[0][0] for g in self.merge)):
            raise ValueError(f"a merge policy keeps each group's representative (its first member){at}; \"keep\" "
                             "lists other experts")
        if self.merge_router not in MERGE_ROUTERS:
            raise ValueError(unknown_choice("merge_router", self.merge_router, MERGE_ROUTERS) + at)
        if any(v is not None for v in (self.top_k, self.skip_beta, self.token_keep, self.batch_pool)):
            raise ValueError(f"a merge policy cannot also set top_k, skip_beta, token_keep or batch_pool{at}: the "
                             "merged checkpoint routes with the model's own router")

    def merge_groups(self) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        """The merged experts in checkpoint order (by representative id): (member ids, weights)."""
        groups = sorted(self.merge, key=lambda g: g[0][0])
        return [(tuple(e for e, _ in g), tuple(w for _, w in g)) for g in groups]

    def to_json(self) -> dict:
        out = {}
        for k, v in asdict(self).items():
            if v == getattr(FULL, k):
                continue
            if k == "merge":
                v = [[[e, w] for e, w in g] for g in v]
            out[k] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_json(cls, data: dict) -> "LayerPolicy":
        if not isinstance(data, dict):
            raise ValueError(f"a layer policy must be an object like {{\"keep\": [0, 1]}}, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown layer policy fields {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
        for k, v in data.items():
            if v is None and k not in ("pool_mode", "fold"):
                continue
            if k == "keep":
                ok = isinstance(v, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in v)
            elif k in ("top_k", "token_keep", "batch_pool"):
                ok = isinstance(v, int) and not isinstance(v, bool)
            elif k == "skip_beta":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            elif k == "fold":
                ok = isinstance(v, bool)
            elif k == "merge":
                ok = isinstance(v, list) and all(
                    isinstance(g, list) and all(isinstance(m, list) and len(m) == 2 and isinstance(m[0], int)
                                                and not isinstance(m[0], bool) and isinstance(m[1], (int, float))
                                                for m in g) for g in v)
            else:
                ok = isinstance(v, str)
            if not ok:
                want = {"keep": "a list of expert ids", "fold": "true or false", "pool_mode": "a string",
                        "merge": "a list of groups of [expert id, weight] pairs", "merge_router": "a string",
                        "skip_beta": "a number"}.get(k, "an integer")
                raise ValueError(f"layer policy field {k!r} must be {want}, got {v!r}"[:200])
        return cls(**{k: (tuple(v) if k == "keep" and v is not None else
                          tuple(tuple((e, w) for e, w in g) for g in v) if k == "merge" and v is not None else v)
                       for k, v in data.items()})


FULL = LayerPolicy()


@dataclass(frozen=True)
class PhasePolicy:
    """One LayerPolicy per MoE layer index (layers not listed run the full router)."""

    layers: dict[int, LayerPolicy] = field(default_factory=dict)

    def for_layer(self, layer: int) -> LayerPolicy:
        return self.layers.get(layer, FULL)

    @property
    def is_identity(self) -> bool:
        return all(p.is_identity for p in self.layers.values())

    @property
    def needs_fold_statistics(self) -> bool:
        """Some layer folds, or picks a batch pool by calibrated importance (both read fold tables)."""
        return any(p.needs_fold_tables or p.batch_pool is not None for p in self.layers.values())

    @property
    def needs_constants(self) -> bool:
        """Some layer replaces dropped experts by their constant outputs (novice experts)."""
        return any(p.needs_constants for p in self.layers.values())

    @property
    def merges(self) -> bool:
        """Some layer merges experts: served as a merged checkpoint (`moetailor prune`), not by routing."""
        return any(p.merges for p in self.layers.values())

    def to_json(self) -> dict:
        return {str(i): p.to_json() for i, p in sorted(self.layers.items()) if not p.is_identity}

    @classmethod
    def from_json(cls, data: dict) -> "PhasePolicy":
        if not isinstance(data, dict):
            raise ValueError(f"(a phase policy) must be an object mapping MoE layer index to a layer policy, like "
                             f"{{\"3\": {{\"keep\": [0, 1]}}}}, got {type(data).__name__}")
        layers = {}
        for i, p in data.items():
            if not str(i).lstrip("-").isdigit():
                raise ValueError(f"phase policy key {i!r} is not a layer index")
            try:
                layers[int(i)] = LayerPolicy.from_json(p)
            except (TypeError, ValueError) as e:
                raise ValueError(f"layer {i}: {e}") from None
        return cls(layers)

    @classmethod
    def uniform(cls, layers: list[int], policy: LayerPolicy) -> "PhasePolicy":
        return cls({i: policy for i in layers})


FULL_PHASE = PhasePolicy()
