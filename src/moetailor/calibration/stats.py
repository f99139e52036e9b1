"""Per-layer, per-expert calibration statistics and their file format.

Everything is stored as sums over calibration tokens (float64), so statistics from two runs could be
added and every derived score (REAP, mean norm, fold tables, beta) is computed from them on read.

File: safetensors with tensors ``layer{i}.{name}`` and string metadata
``{"format": "moetailor-expert-stats", "version": "1", "meta": <JSON>}`` (see docs/plans.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

STATS_FORMAT = "moetailor-expert-stats"
STATS_VERSION = 1
BETA_BINS = 1000          # fixed-bin histogram of w_2 / w_1 over [0, 1]: median resolution 1e-3
FOLD_SCALE_CLIP = 4.0     # ExFold clips S to [-4, 4]
FOLD_EPS = 1e-3           # ExFold's denominator epsilon

REQUIRED = ("frequency", "mass", "ean", "weighted_ean", "coselect", "beta_hist")
FOLD = ("fold_uv", "fold_vv", "fold_uu", "fold_count", "norm_sum", "norm_count")
# expert outputs y = E_j(x) (the down projection's output) over the tokens routed to j: files written
# before these were recorded load without them (plans that need them say to re-run calibrate)
OUTPUT = ("out_max", "out_sum", "out_sq")
# every expert's outputs over every calibration token (``calibrate --all-experts`` only): HC-SMoE's signature
ALL_OUTPUT = ("out_all_sum", "out_all_count")
PAIRS = ("coselect", "fold_uv", "fold_vv", "fold_uu", "fold_count")   # [E, E]; out_sum [E, H]; the others [E], beta_hist [BETA_BINS]
SIGNED = ("fold_uv", "out_sum", "out_all_sum")    # sums of inner products / outputs; every other statistic is a sum of counts or norms (>= 0)
RECALIBRATE_OUTPUTS = ("these statistics hold no expert output statistics (largest output magnitude, mean output, "
                       "output variance: recorded since super-expert protection and novice experts were added); "
                       "re-run `moetailor calibrate` on the model to record them")


def check_layer_tensors(tensors: dict, num_experts: int, where: str) -> None:
    """ValueError naming the tensor when a statistic has the wrong shape, is not finite, or is negative
    where only sums of counts and norms can stand: a NaN score would keep arbitrary experts and a
    5-entry tensor would make a 5-expert plan."""
    E = num_experts
    for name, t in tensors.items():
        if t is None:
            continue
        shape = (E, E) if name in PAIRS else (BETA_BINS,) if name == "beta_hist" else (E,)
        if name in ("out_sum", "out_all_sum"):   # [E, H]: the hidden size is the file's own
            shape = (E, t.shape[1] if t.dim() == 2 else -1)
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {list(t.shape)}, expected {list(shape)} for {E} experts; "
                             "the file is corrupt — rerun `moetailor calibrate`")
        if not t.is_floating_point() and not t.dtype.is_signed and t.dtype != torch.uint8:
            continue
        values = t.double()
        if not torch.isfinite(values).all():
            raise ValueError(f"{where}: {name} holds {int((~torch.isfinite(values)).sum())} NaN or infinite values; "
                             "the file is corrupt — rerun `moetailor calibrate`")
        if name not in SIGNED and (values < 0).any():
            raise ValueError(f"{where}: {name} holds negative values, which a sum of counts or norms cannot; the "
                             "file is corrupt — rerun `moetailor calibrate`")


class StatsMismatch(ValueError):
    pass


@dataclass
class LayerStats:
    """Sums over the calibration tokens T_j routed to expert j (hard top-k membership)."""

    frequency: torch.Tensor      # [E] |T_j|
    mass: torch.Tensor           # [E] sum_{T_j} g_j            (routing mass / soft count)
    ean: torch.Tensor            # [E] sum_{T_j} ||E_j(x)||
    weighted_ean: torch.Tensor   # [E] sum_{T_j} g_j ||E_j(x)||
    coselect: torch.Tensor       # [E, E] tokens routed to both i and j (diagonal = frequency)
    beta_hist: torch.Tensor      # [BETA_BINS] histogram of w_2 / w_1 per token
    # ExFold sums over pairs (u = source output, v = target output, w = ||u||); None unless --fold
    fold_uv: torch.Tensor | None = None     # [E, E] sum w <u, v>
    fold_vv: torch.Tensor | None = None     # [E, E] sum w ||v||^2
    fold_uu: torch.Tensor | None = None     # [E, E] sum w ||u||^2
    fold_count: torch.Tensor | None = None  # [E, E] observations of the pair
    norm_sum: torch.Tensor | None = None    # [E] sum ||E_j(x)|| over every token the fold pass computed j on
    norm_count: torch.Tensor | None = None  # [E]
    # expert outputs y over T_j (None in files written before they were recorded)
    out_max: torch.Tensor | None = None     # [E] max over T_j of max_i |y_i| (super experts' outliers)
    out_sum: torch.Tensor | None = None     # [E, H] sum over T_j of y (novice constant = out_sum / frequency)
    out_sq: torch.Tensor | None = None      # [E] sum over T_j of ||y||^2 (with out_sum: the output variance)
    # expert outputs over every calibration token (None unless --all-experts)
    out_all_sum: torch.Tensor | None = None    # [E, H] sum over all tokens of E_j(x)
    out_all_count: torch.Tensor | None = None  # [E] tokens summed

    @classmethod
    def zeros(cls, num_experts: int, fold: bool, hidden_size: int | None = None,
              all_outputs: bool = False) -> "LayerStats":
        E = num_experts
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        extra = dict(fold_uv=z(E, E), fold_vv=z(E, E), fold_uu=z(E, E), fold_count=z(E, E),
                     norm_sum=z(E), norm_count=z(E)) if fold else {}
        if hidden_size is not None:
            extra.update(out_max=z(E), out_sum=z(E, hidden_size), out_sq=z(E))
            if all_outputs:
                extra.update(out_all_sum=z(E, hidden_size), out_all_count=z(E))
        return cls(z(E), z(E), z(E), z(E), z(E, E), z(BETA_BINS), **extra)

    @property
    def num_experts(self) -> int:
        return self.frequency.numel()

    @property
    def has_fold(self) -> bool:
        return self.fold_uv is not None

    @property
    def has_outputs(self) -> bool:
        return self.out_sum is not None

    def _outputs(self) -> None:
        if not self.has_outputs:
            raise ValueError(RECALIBRATE_OUTPUTS)

    @property
    def mean_output(self) -> torch.Tensor:
        """MoNE's novice constant c_j: the mean of E_j(x) over T_j, router weights left out (zeros for a
        never-routed expert: it is never substituted on the calibration data either).  [E, H]"""
        self._outputs()
        return self.out_sum / self.frequency.clamp_min(1)[:, None]

    @property
    def has_all_outputs(self) -> bool:
        return self.out_all_sum is not None

    @property
    def mean_output_all(self) -> torch.Tensor | None:
        """HC-SMoE's expert signature: the mean of E_j(x) over every calibration token (None unless the
        statistics were calibrated with --all-experts).  [E, H]"""
        if self.out_all_sum is None:
            return None
        return self.out_all_sum / self.out_all_count.clamp_min(1)[:, None]

    @property
    def output_variance(self) -> torch.Tensor:
        """Mean over T_j of ||E_j(x) - c_j||^2: what substituting c_j costs per routed token (MoNE's score).  [E]"""
        self._outputs()
        n = self.frequency.clamp_min(1)
        return (self.out_sq / n - (self.out_sum / n[:, None]).pow(2).sum(-1)).clamp_min(0.0)

    @property
    def reap(self) -> torch.Tensor:
        """REAP: mean over T_j of g_j ||E_j(x)|| (0 for never-routed experts).  [E]"""
        return self.weighted_ean / self.frequency.clamp_min(1)

    @property
    def mean_norm(self) -> torch.Tensor:
        """Mean ||E_j(x)|| over the tokens routed to j (0 for never-routed experts).  [E]"""
        return self.ean / self.frequency.clamp_min(1)

    @property
    def beta(self) -> float | None:
        """NAEE's beta: the median over tokens of w_2 / w_1, read from the histogram (linear
        interpolation inside the median's bin, so accurate to 1 / BETA_BINS). None if no tokens."""
        n = float(self.beta_hist.sum())
        if n == 0:
            return None
        cum = torch.cumsum(self.beta_hist, 0)
        b = int(torch.searchsorted(cum, torch.tensor(n / 2, dtype=cum.dtype)))
        below = float(cum[b - 1]) if b > 0 else 0.0
        inside = float(self.beta_hist[b])
        frac = (n / 2 - below) / inside if inside > 0 else 0.5
        return min(1.0, (b + frac) / BETA_BINS)

    def fold_tables(self):
        """ExFold's S (scale) and L (relative loss) for every source -> target pair.
        S = sum w<u,v> / (sum w||v||^2 + 1e-3), clipped to [-4, 4];
        L = (sum w||u||^2 - 2 S sum w<u,v> + S^2 sum w||v||^2) / sum w||u||^2;
        unobserved pairs: S = 0, L = inf; the diagonal is the identity (S = 1, L = 0)."""
        from ..routing import FoldTables

        if not self.has_fold:
            raise ValueError("these statistics hold no fold tables; rerun `moetailor calibrate ... --fold`")
        scale = (self.fold_uv / (self.fold_vv + FOLD_EPS)).clamp(-FOLD_SCALE_CLIP, FOLD_SCALE_CLIP)   # [E, E]
        loss = (self.fold_uu - 2 * scale * self.fold_uv + scale**2 * self.fold_vv) / self.fold_uu.clamp_min(1e-30)
        seen, eye = self.fold_count > 0, torch.eye(self.num_experts, dtype=torch.bool)
        scale = torch.where(eye, 1.0, torch.where(seen, scale, 0.0))
        loss = torch.where(eye, 0.0, torch.where(seen, loss.clamp_min(0.0), float("inf")))
        mean_norm = self.norm_sum / self.norm_count.clamp_min(1)
        return FoldTables(scale=scale.float(), loss=loss.float(), mean_norm=mean_norm.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        names = (REQUIRED + (FOLD if self.has_fold else ()) + (OUTPUT if self.has_outputs else ())
                 + (ALL_OUTPUT if self.has_all_outputs else ()))
        return {n: getattr(self, n) for n in names}


@dataclass
class ExpertStats:
    meta: dict                                       # model fingerprint, data spec, tokens, gate, command, ...
    layers: dict[int, LayerStats] = field(default_factory=dict)

    @property
    def model(self) -> dict:
        return self.meta["model"]

    @property
    def has_fold(self) -> bool:
        return all(l.has_fold for l in self.layers.values())

    @property
    def has_outputs(self) -> bool:
        """Whether the file records expert outputs (super experts, novice constants)."""
        return all(l.has_outputs for l in self.layers.values())

    @property
    def has_expert_norms(self) -> bool:
        """Whether EAN and REAP were measured: statistics observed on an engine whose experts kernel gives
        no per-route output hold the router's statistics only (``observed.expert_outputs`` says "none")."""
        return not str(self.meta.get("observed", {}).get("expert_outputs", "")).startswith("none")

    def require_outputs(self, what: str) -> None:
        """A one-line error for ``what`` (a plan option) on statistics written before outputs were recorded."""
        if not self.has_outputs:
            raise ValueError(f"{what} needs expert output statistics (largest output magnitude, mean output, output "
                             "variance), which these statistics were written without; re-run `moetailor calibrate` "
                             "on the model to record them")

    def check_model(self, model) -> None:
        """Raise StatsMismatch when these statistics were collected on another model."""
        from ..models.loading import fingerprint_mismatch, model_fingerprint

        problem = fingerprint_mismatch(self.model, model_fingerprint(model))
        if problem:
            raise StatsMismatch(f"statistics do not match the model ({problem}); run `moetailor calibrate` on "
                                f"this model (the stats came from {self.model.get('source')!r})")

    def fold_tables(self) -> dict:
        return {i: l.fold_tables() for i, l in self.layers.items()}

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename)."""
        from safetensors.torch import save_file

        from ..outputs import atomic_path

        tensors = {f"layer{i}.{name}": t.contiguous() for i, l in sorted(self.layers.items())
                   for name, t in l.tensors().items()}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": STATS_FORMAT, "version": str(STATS_VERSION),
                                                   "meta": json.dumps(self.meta)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "ExpertStats":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"statistics file {path} does not exist; create it with `moetailor calibrate`")
        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for truncated / foreign files
            raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be truncated — rerun "
                             "`moetailor calibrate`") from None
        if header.get("format") != STATS_FORMAT:
            raise ValueError(f"{path} is not a moetailor statistics file (format tag {header.get('format')!r}, "
                             f"expected {STATS_FORMAT!r}); create one with `moetailor calibrate`")
        if header.get("version") != str(STATS_VERSION):
            raise ValueError(f"{path} has statistics version {header.get('version')}, this moetailor reads "
                             f"version {STATS_VERSION}; rerun `moetailor calibrate`")
        try:
            meta = json.loads(header["meta"])
        except (KeyError, json.JSONDecodeError, RecursionError):
            raise ValueError(f"{path} has no readable metadata; rerun `moetailor calibrate`") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict) or "moe_layers" not in meta["model"]:
            raise ValueError(f"{path} lacks the model fingerprint in its metadata; rerun `moetailor calibrate`")
        fp = meta["model"]
        if not (isinstance(fp["moe_layers"], list) and all(isinstance(i, int) for i in fp["moe_layers"])
                and isinstance(fp.get("num_experts"), int) and fp["num_experts"] >= 1):
            raise ValueError(f"{path} has a malformed model fingerprint (moe_layers must be a list of layer indices, "
                             f"num_experts an integer: got {fp.get('moe_layers')!r}, {fp.get('num_experts')!r}"[:240]
                             + "); rerun `moetailor calibrate`")
        layers = {}
        for i in meta["model"]["moe_layers"]:
            got = {n: tensors.get(f"layer{i}.{n}") for n in REQUIRED + FOLD + OUTPUT + ALL_OUTPUT}
            missing = [n for n in REQUIRED if got[n] is None]
            if missing:
                raise ValueError(f"{path} lacks {missing} for layer {i}; it is incomplete — rerun `moetailor calibrate`")
            for group in (FOLD, OUTPUT, ALL_OUTPUT):   # optional groups: all or nothing
                if any(got[n] is None for n in group):
                    got = {n: v for n, v in got.items() if n not in group}
            E = meta["model"]["num_experts"]
            if got["frequency"].numel() != E:
                raise ValueError(f"{path} layer {i} has {got['frequency'].numel()} experts but its metadata says {E}")
            check_layer_tensors(got, E, f"{path} layer {i}")
            layers[i] = LayerStats(**got)
        return cls(meta, layers)


def load_fold_tables(stats, model=None) -> dict:
    """ExFold tables per MoE layer, ``dict[int, FoldTables]``, from a stats path or ExpertStats;
    checked against ``model`` when given."""
    if not isinstance(stats, ExpertStats):
        stats = ExpertStats.load(stats)
    if model is not None:
        stats.check_model(model)
    return stats.fold_tables()   # statistics without fold tables: LayerStats.fold_tables says to recalibrate
