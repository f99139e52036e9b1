"""One candidate of the search and the plan it becomes.

A candidate is a decode pool per MoE layer (the top ``sizes[l]`` experts of layer l by
``criterion``, from ``plans.criteria.make_plan``), what happens to routes outside it (``mask``:
re-routed inside the pool, what a pruned checkpoint computes; ``fold``: folded onto the kept
expert that best reproduces them, ``plans.techniques.pool_with_fold``; ``novice``: replaced by the
expert's mean output, MoNE; ``merge``: every expert merged into one of ``sizes[l]`` groups by
``merge`` = hcsmoe | msmoe, ``plans.merging``, served as the merged checkpoint), whether the
model's ``protect_super`` super experts are kept whatever their score, and optionally fewer
experts per token (``top_k``, expert skipping). Prefill always runs the full router (phase-aware).

Its budget is the share of routed expert weights a decode step reads at batch B: per layer the
expected union of B tokens' routes inside the pool, m(1-(1-k'/m)^B) (``routing.traffic``), over
the layer's E experts, averaged over layers. At large B it is the pool share m/E; at batch 1 it is
k'/E whatever the pool, so top-k reduction only pays at small batches and pruning at large ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..plans.plan import Plan
from ..routing.policy import PhasePolicy
from ..routing.traffic import expected_distinct
from ..tables import unknown_choice

POOL_MODES = ("mask", "fold", "novice", "merge")
MERGES = ("hcsmoe", "msmoe")
ALLOCATIONS = ("uniform", "sensitivity")


@dataclass(frozen=True)
class Candidate:
    criterion: str
    sizes: tuple[int, ...]          # decode pool per MoE layer (E = the whole layer)
    pool_mode: str = "mask"         # "mask" | "fold" | "novice" | "merge"
    top_k: int | None = None        # experts per token (None = the model's k)
    allocation: str = "uniform"     # how ``sizes`` were chosen: "uniform" | "sensitivity"
    protect_super: int = 0          # the model's N super experts kept whatever their score
    merge: str | None = None        # pool_mode "merge": "hcsmoe" | "msmoe"

    def __post_init__(self) -> None:
        if self.pool_mode not in POOL_MODES:
            raise ValueError(unknown_choice("pool mode", self.pool_mode, POOL_MODES))
        if (self.pool_mode == "merge") != (self.merge is not None) or (self.merge and self.merge not in MERGES):
            raise ValueError(f"a merge candidate names its method ({', '.join(MERGES)}), no other candidate does")
        if self.pool_mode in ("novice", "merge") and self.top_k is not None:
            raise ValueError(f"a {self.pool_mode} candidate keeps the model's top-k")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(unknown_choice("allocation", self.allocation, ALLOCATIONS))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))

    @property
    def key(self) -> str:
        """A file-name-safe identifier: ``reap-u32-mask``, ``ean-s64.32.32.32.32.24-fold-k6``."""
        sizes = (f"u{self.sizes[0]}" if self.allocation == "uniform" and len(set(self.sizes)) == 1
                 else ("s" if self.allocation == "sensitivity" else "l") + ".".join(map(str, self.sizes)))
        mode = self.merge if self.pool_mode == "merge" else self.pool_mode
        return (f"{self.criterion}-{sizes}-{mode}" + (f"-k{self.top_k}" if self.top_k else "")
                + (f"-super{self.protect_super}" if self.protect_super else ""))

    def describe(self, num_experts: int) -> str:
        """Short words for tables: ``reap 32/64 folded``, ``ean 64/32/32/32/32/24 k'=6``."""
        pools = (f"{self.sizes[0]}/{num_experts}" if len(set(self.sizes)) == 1
                 else "/".join(map(str, self.sizes)))
        if self.pool_mode == "merge":
            head = f"{'HC-SMoE' if self.merge == 'hcsmoe' else 'M-SMoE'} merged {pools}"
        else:
            head = f"{self.criterion} {pools}" + {"fold": " folded", "novice": " novice"}.get(self.pool_mode, "")
        return (head + (f" k'={self.top_k}" if self.top_k else "")
                + (f" +{self.protect_super} super" if self.protect_super else ""))

    def is_full(self, num_experts: int) -> bool:
        return all(s == num_experts for s in self.sizes) and self.top_k is None

    def pool_share(self, num_experts: int) -> float:
        """Share of the routed experts the decode pool holds (resident on a decode instance)."""
        return sum(self.sizes) / (len(self.sizes) * num_experts)

    def read_share(self, num_experts: int, top_k: int, batch: int) -> float:
        """Expected share of routed expert weights one decode step of ``batch`` sequences reads."""
        k = self.top_k or top_k
        return sum(expected_distinct(m, min(k, m), batch) for m in self.sizes) / (len(self.sizes) * num_experts)

    def runs_on_vllm(self) -> bool:
        """Whether vLLM serves this plan phase-aware: masked, folded and novice pools and reduced top-k
        run in vLLM's plugin through the engine's own ``route`` (integrations/vllm/routing.py, tested in
        test_vllm_techniques.py; novice constants added to the layer's output, test_vllm_novice.py); a
        merged pool is a stock checkpoint (``checkpoint``), decoded by vLLM in a disaggregated pair
        (`moetailor serve MODEL --backend vllm --decode-model DIR`)."""
        return self.pool_mode in ("mask", "fold", "novice", "merge")

    @property
    def checkpoint(self) -> bool:
        """Served as a checkpoint of its own (a merged decoder), not as a plan over the model."""
        return self.pool_mode == "merge"

    def to_json(self) -> dict:
        out = {"criterion": self.criterion, "sizes": list(self.sizes), "pool_mode": self.pool_mode,
               "top_k": self.top_k, "allocation": self.allocation}
        if self.protect_super:
            out["protect_super"] = self.protect_super
        if self.merge:
            out["merge"] = self.merge
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Candidate":
        return cls(data["criterion"], tuple(data["sizes"]), data["pool_mode"], data.get("top_k"),
                   data.get("allocation", "uniform"), data.get("protect_super", 0), data.get("merge"))


def candidate_plan(candidate: Candidate, stats, model_fp: dict, stats_path: str | None, groups: str = "balanced",
                   model=None, **meta) -> Plan:
    """The phase-aware plan of ``candidate``: prefill full, decode pooled (``make_plan``), folded,
    replaced by constants, merged and top-k reduced as the candidate says. ``model_fp`` checks the
    statistics belong to the model; ``model`` (its routers) is needed by msmoe merging."""
    from ..plans.criteria import make_plan
    from ..plans.techniques import pool_with_fold

    layers = list(model_fp["moe_layers"])
    if len(candidate.sizes) != len(layers):
        raise ValueError(f"candidate {candidate.key} has {len(candidate.sizes)} pool sizes for {len(layers)} MoE layers")
    if candidate.pool_mode == "merge" and len(set(candidate.sizes)) > 1:
        raise ValueError(f"candidate {candidate.key}: a merged checkpoint has one expert count for every layer")
    plan = make_plan(stats, model if candidate.merge == "msmoe" else None, candidate.criterion, layers=dict(zip(layers, candidate.sizes)), phase="decode",
                     stats_path=stats_path, groups=groups, protect_super=candidate.protect_super,
                     novice=candidate.pool_mode == "novice", merge=candidate.merge)
    decode = plan.decode
    if candidate.pool_mode == "fold":
        if not stats.has_fold:
            raise ValueError("folding needs fold tables in the statistics; calibrate with --fold")
        decode = pool_with_fold(decode, fold=True)
    if candidate.top_k is not None:
        decode = PhasePolicy({i: replace(p, top_k=candidate.top_k) for i, p in decode.layers.items()})
    E = model_fp["num_experts"]
    record = {**plan.meta, "tune": {**candidate.to_json(), "key": candidate.key,
                                    "pool_share": round(candidate.pool_share(E), 6)}, **meta}
    record["keep_ratio"] = round(candidate.pool_share(E), 6)
    fold_stats = stats_path if candidate.pool_mode in ("fold", "novice") else None
    out = replace(plan, decode=decode, meta=record, fold_stats=fold_stats)
    out.validate()
    return out
