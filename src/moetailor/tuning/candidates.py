"""One candidate of the search and the plan it becomes.

A candidate is a decode pool per MoE layer (the top ``sizes[l]`` experts of layer l by
``criterion``, from ``plans.criteria.make_plan``), what happens to routes outside it (``mask``:
re-routed inside the pool, what a pruned checkpoint computes; ``fold``: folded onto the kept
expert that best reproduces them, ``plans.techniques.pool_with_fold``) and optionally fewer
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

POOL_MODES = ("mask", "fold")
ALLOCATIONS = ("uniform", "sensitivity")


@dataclass(frozen=True)
class Candidate:
    criterion: str
    sizes: tuple[int, ...]          # decode pool per MoE layer (E = the whole layer)
    pool_mode: str = "mask"         # "mask" | "fold"
    top_k: int | None = None        # experts per token (None = the model's k)
    allocation: str = "uniform"     # how ``sizes`` were chosen: "uniform" | "sensitivity"

    def __post_init__(self) -> None:
        if self.pool_mode not in POOL_MODES:
            raise ValueError(f"pool mode {self.pool_mode!r} is not one of {POOL_MODES}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {self.allocation!r} is not one of {ALLOCATIONS}")
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))

    @property
    def key(self) -> str:
        """A file-name-safe identifier: ``reap-u32-mask``, ``ean-s64.32.32.32.32.24-fold-k6``."""
        sizes = (f"u{self.sizes[0]}" if self.allocation == "uniform" and len(set(self.sizes)) == 1
                 else ("s" if self.allocation == "sensitivity" else "l") + ".".join(map(str, self.sizes)))
        return f"{self.criterion}-{sizes}-{self.pool_mode}" + (f"-k{self.top_k}" if self.top_k else "")

    def describe(self, num_experts: int) -> str:
        """Short words for tables: ``reap 32/64 folded``, ``ean 64/32/32/32/32/24 k'=6``."""
        pools = (f"{self.sizes[0]}/{num_experts}" if len(set(self.sizes)) == 1
                 else "/".join(map(str, self.sizes)))
        return (f"{self.criterion} {pools}" + (" folded" if self.pool_mode == "fold" else "")
                + (f" k'={self.top_k}" if self.top_k else ""))

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
        """Whether vLLM's plugin serves this plan: every routing policy a candidate makes (masked and
        folded pools, reduced top-k; a folded plan carries its ``fold_stats``) runs there through the
        engine's own ``route`` (integrations/vllm/routing.py, tested in test_vllm_techniques.py)."""
        return self.pool_mode in ("mask", "fold")

    def to_json(self) -> dict:
        return {"criterion": self.criterion, "sizes": list(self.sizes), "pool_mode": self.pool_mode,
                "top_k": self.top_k, "allocation": self.allocation}

    @classmethod
    def from_json(cls, data: dict) -> "Candidate":
        return cls(data["criterion"], tuple(data["sizes"]), data["pool_mode"], data.get("top_k"),
                   data.get("allocation", "uniform"))


def candidate_plan(candidate: Candidate, stats, model_fp: dict, stats_path: str | None, groups: str = "balanced",
                   **meta) -> Plan:
    """The phase-aware plan of ``candidate``: prefill full, decode pooled (``make_plan``), folded and
    top-k reduced as the candidate says. ``model_fp`` checks the statistics belong to the model."""
    from ..plans.criteria import make_plan
    from ..plans.techniques import pool_with_fold

    layers = list(model_fp["moe_layers"])
    if len(candidate.sizes) != len(layers):
        raise ValueError(f"candidate {candidate.key} has {len(candidate.sizes)} pool sizes for {len(layers)} MoE layers")
    plan = make_plan(stats, None, candidate.criterion, layers=dict(zip(layers, candidate.sizes)), phase="decode",
                     stats_path=stats_path, groups=groups)
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
    fold_stats = stats_path if candidate.pool_mode == "fold" else None
    out = replace(plan, decode=decode, meta=record, fold_stats=fold_stats)
    out.validate()
    return out
