"""`moetailor bench decode`: decode speed against the memory-bandwidth floor, per pool and batch.

Every pool runs side by side in one run (a shared machine's noise hits all alike): step time,
tokens/s, distinct experts per layer beside m'(1-(1-k/m')^B), bytes per step, achieved bandwidth
beside the measured read bandwidth, speedup beside the ideal traffic ratio, and transformers ``generate``.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .. import kernels
from .bandwidth import gemv_bandwidth, read_bandwidth
from .measure import MAX_STEADY_SPREAD, MIN_STEADY_STEPS, DecodeResult, engine_decode, hf_decode, make_llm
from .pools import Pool, make_pools, plan_pool
from .report import Report, close, figure
from ..routing.traffic import expected_distinct


@dataclass
class DecodeConfig:
    model: str = "both"
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    keeps: list[float] = field(default_factory=lambda: [0.75, 0.5, 0.25])
    top_ks: list[int] = field(default_factory=list)
    steps: int | None = None
    quick: bool = False
    synthetic_layers: int = 2
    hf: bool = True
    pruned: bool = True
    plans: list[str] = field(default_factory=list)   # extra decode pools from plan files (e.g. folding)
    prompt_len: int = 16
    dtype: str = "float32"   # the weights as measured: float32, or bfloat16 (what real checkpoints ship)

    def resolved(self) -> "DecodeConfig":
        if not self.quick:
            return replace(self, steps=self.steps or 12)
        return replace(self, batches=[b for b in self.batches if b in (1, 8, 64)] or self.batches[:3],
                       keeps=[0.5] if 0.5 in self.keeps or not self.keeps else self.keeps[:1],
                       steps=self.steps or QUICK_STEPS)


HF_STEP_LIMIT_S = 3.0   # transformers steps slower than this end the transformers sweep
QUICK_STEPS = 16        # --quick: enough timed steps for a median (4 gave 0.62x for a half pool at batch 1)
HF_GOAL_BATCH = 32      # the batch the "engine >= 1.5x transformers" goal names


def bandwidth_share(bandwidth: float, read_bw: float) -> str:
    """A step's bytes per second as a share of the measured read bandwidth, printed: never above 100%,
    since a step cannot stream weights faster than memory reads them. Above it, the weights were
    served from cache (a model smaller than the caches) or the step's time is noise."""
    share = bandwidth / read_bw
    return f"{share:.0%}" if share <= 1 else ">100% (cache-resident or noise)"


def flagged(text: str, *results) -> str:
    """``text`` marked "(noisy)" where any of ``results`` (DecodeResult) is (``measure.step_is_noisy``)."""
    return text + " (noisy)" if any(r.noisy for r in results) else text


@dataclass
class Measured:
    model: str
    pool: Pool
    result: DecodeResult


def load_bench_model(name: str, synthetic_layers: int = 2, dtype: str = "float32"):
    """'synthetic' (built in memory), 'reference' or a local checkpoint path, its weights in ``dtype``."""
    if name == "synthetic":
        from .synthetic import synthetic_model
        return synthetic_model(synthetic_layers).to(getattr(torch, dtype))
    from ..models.loading import load_model
    return load_model(name, dtype=getattr(torch, dtype))


def model_names(spec: str) -> list[str]:
    if spec != "both":
        return [spec]
    from ..models.loading import REFERENCE_DIR
    return ["synthetic", "reference"] if (REFERENCE_DIR / "config.json").exists() else ["synthetic"]


def measure_model(name: str, cfg: DecodeConfig, progress_desc: str = "decode", model=None
                  ) -> tuple[list[Measured], dict]:
    """Every pool at every batch for one model, plus transformers' step time per batch (if asked).
    ``model``: an already built model to measure under ``name`` (default: load it by name)."""
    from tqdm import tqdm

    if model is None:
        model = load_bench_model(name, cfg.synthetic_layers, cfg.dtype)
    hf: dict[int, float] = {}
    if cfg.hf:  # stock transformers first, before the engine installs its routing control
        for b in tqdm(cfg.batches, desc=f"{name}: transformers generate", unit="batch"):
            hf[b] = hf_decode(model, b, cfg.prompt_len, cfg.steps)
            if hf[b] > HF_STEP_LIMIT_S:  # larger batches only get slower: stop rather than run for hours
                hf["stopped"] = (b, hf[b])
                break
    pools = make_pools(model, cfg.keeps, cfg.pruned, cfg.top_ks) + [plan_pool(model, p) for p in cfg.plans]
    max_len = cfg.prompt_len + cfg.steps + 4
    pack = kernels.packed_weights_pay()   # the models are handed over: transformers and pruning ran above
    llm = make_llm(model, max(cfg.batches), max_len, pack_weights=pack)
    pruned_llms = {id(p): make_llm(p.model, max(cfg.batches), max_len, pack_weights=pack)
                   for p in pools if p.kind == "pruned"}
    out: list[Measured] = []
    bar = tqdm(total=len(cfg.batches) * len(pools), desc=f"{name}: {progress_desc}", unit="run")
    for b in cfg.batches:
        for pool in pools:
            bar.set_postfix_str(f"batch {b}, {pool.label}")
            if pool.kind == "pruned":
                r = engine_decode(pruned_llms[id(pool)], b, cfg.prompt_len, cfg.steps)
            else:
                llm.set_plan(pool.plan)
                r = engine_decode(llm, b, cfg.prompt_len, cfg.steps,
                                  expert_top_k=pool.top_k if pool.kind == "top-k" else None)
            out.append(Measured(name, pool, r))
            bar.update()
    bar.close()
    llm.set_plan(None)
    del llm, pruned_llms, pools, model
    gc.collect()
    return out, hf


def run_decode(cfg: DecodeConfig, out: Path, command: str = "") -> Report:
    cfg = cfg.resolved()
    rep = Report("Decode: speed against the memory-bandwidth floor", out, command)
    read_bw = read_bandwidth(512 << 20 if cfg.quick else 1 << 30)
    gemv_bw = gemv_bandwidth(experts=20 if cfg.quick else 40)
    rep.note(f"Machine read bandwidth (torch.sum over {'512 MiB' if cfg.quick else '1 GiB'} fp32, best of 5): "
             f"**{read_bw / 1e9:.1f} GB/s**; fp32 GEMV over expert weights (one token through "
             f"{20 if cfg.quick else 40} experts of 2048x1024): **{gemv_bw / 1e9:.1f} GB/s**. "
             f"{cfg.steps} timed decode steps per cell (median), prompts of {cfg.prompt_len} tokens, "
             f"weights in {cfg.dtype}.")
    rep.data = {"read_bandwidth": read_bw, "gemv_bandwidth": gemv_bw, "models": {}}
    goals = []
    for name in model_names(cfg.model):
        measured, hf = measure_model(name, cfg)
        _tables(rep, name, measured, hf, read_bw)
        _plots(rep, name, measured, read_bw, gemv_bw)
        rep.data["models"][name] = _json(measured, hf)
        goals += _goals(name, measured, hf, read_bw)
    rep.table("Goals against this run", ["goal", "model", "measured", "met"], goals)
    return rep


def _by_batch(measured: list[Measured]) -> dict[int, dict[str, Measured]]:
    table: dict[int, dict[str, Measured]] = {}
    for m in measured:
        table.setdefault(m.result.batch, {})[m.pool.label] = m
    return table


def _tables(rep: Report, name: str, measured: list[Measured], hf: dict[int, float], read_bw: float) -> None:
    rows = []
    for b, cells in _by_batch(measured).items():
        full = cells["full"].result
        for label, c in cells.items():
            r, p = c.result, c.pool
            speedup = full.step_s / r.step_s
            ideal = full.total_bytes / r.total_bytes
            rows.append((label, b, flagged(f"{r.step_s * 1e3:.1f}", r), f"{r.tokens_per_s:.1f}", f"{r.distinct:.1f}",
                         f"{expected_distinct(p.experts, p.top_k, b):.1f}", f"{r.expert_bytes / 1e6:.0f}",
                         f"{r.total_bytes / 1e6:.0f}", f"{r.bandwidth / 1e9:.1f}", bandwidth_share(r.bandwidth, read_bw),
                         flagged(f"{speedup:.2f}x", r, full), f"{ideal:.2f}x", f"{speedup / ideal:.2f}"))
    rep.table(f"{name}: decode per pool and batch",
              ["pool", "batch", "step ms", "tok/s", "distinct/layer", "formula", "expert MB/step", "total MB/step",
               "GB/s", "of read BW", "speedup", "ideal (bytes)", "speedup/ideal"], rows)
    if any(m.result.noisy for m in measured):
        rep.note(f"{name}: (noisy) = fewer than {MIN_STEADY_STEPS} timed steps, or an interquartile range of step "
                 f"times above {MAX_STEADY_SPREAD:.0%} of the median: rerun with more --steps on a quieter machine "
                 "before reading those figures.")
    if hf:
        rows = []
        if "stopped" in hf:
            b, s = hf["stopped"]
            rep.note(f"{name}: transformers generate took {s:.1f} s per decode step at batch {b}; larger batches "
                     f"were not run through it (limit {HF_STEP_LIMIT_S:g} s per step).")
        for b, cells in _by_batch(measured).items():
            if b in hf:
                e = cells["full"].result.step_s
                rows.append((b, f"{e * 1e3:.1f}", f"{hf[b] * 1e3:.1f}", f"{b / e:.1f}", f"{b / hf[b]:.1f}",
                             f"{hf[b] / e:.2f}x"))
        rep.table(f"{name}: engine (full pool) vs transformers generate",
                  ["batch", "engine step ms", "transformers step ms", "engine tok/s", "transformers tok/s",
                   "engine / transformers"], rows)


def _plots(rep: Report, name: str, measured: list[Measured], read_bw: float, gemv_bw: float) -> None:
    series = {}
    for m in measured:
        series.setdefault(m.pool.label, []).append(m)

    def plot(file: str, ylabel: str, heading: str, value, formula=None, lines=(), **legend) -> None:
        """A line per pool: ``value`` of each measurement against the batch (``formula`` dashed beside it)."""
        fig, ax = figure("batch", ylabel, f"{name}: {heading}", logx=True)
        for i, (label, ms) in enumerate(series.items()):
            batches = [m.result.batch for m in ms]
            ax.plot(batches, [value(m) for m in ms], marker="o", ms=3, color=f"C{i}", label=label)
            if formula is not None:
                ax.plot(batches, [formula(m) for m in ms], ls="--", color=f"C{i}", lw=1)
        for y, color, ls, label in lines:
            ax.axhline(y, color=color, ls=ls, lw=1, label=label)
        ax.legend(fontsize=8, **legend)
        rep.plot(f"{name}_{file}.png", fig)
        close(fig)

    plot("tokens_per_s", "decode tokens/s", "tokens/s vs batch per pool", lambda m: m.result.tokens_per_s)
    plot("bandwidth", "GB/s", "achieved bandwidth vs the measured floor", lambda m: m.result.bandwidth / 1e9,
         lines=((read_bw / 1e9, "black", "--", "read bandwidth (torch.sum)"),
                (0.5 * read_bw / 1e9, "grey", ":", "50% of read bandwidth"),
                (gemv_bw / 1e9, "brown", "-.", "fp32 GEMV probe")))
    plot("distinct_experts", "distinct experts per layer per step", "measured vs m'(1-(1-k/m')^B)",
         lambda m: m.result.distinct, lambda m: expected_distinct(m.pool.experts, m.pool.top_k, m.result.batch),
         title="solid: measured, dashed: formula")


def _goals(name: str, measured: list[Measured], hf: dict[int, float], read_bw: float) -> list[tuple]:
    rows = []
    by = _by_batch(measured)
    if name == "synthetic":
        for b, target in ((1, 0.6), (8, 0.5)):
            if b in by:
                full = by[b]["full"].result
                share = full.bandwidth / read_bw
                met = "n/a" if share > 1 or full.noisy else "yes" if share >= target else "no"
                rows.append((f"full-pool decode >= {target:.0%} of read BW at batch {b}", name,
                             flagged(bandwidth_share(full.bandwidth, read_bw), full), met))
    for kind in ("mask", "pruned"):
        cells = [(b, c[f"{kind} 50%"]) for b, c in by.items() if f"{kind} 50%" in c]
        if cells:
            ratios = []
            for b, c in cells:
                full = by[b]["full"].result
                ratios.append((b, (full.step_s / c.result.step_s) / (full.total_bytes / c.result.total_bytes)))
            worst = min(r for _, r in ratios)
            noisy = any(c.result.noisy or by[b]["full"].result.noisy for b, c in cells)
            rows.append((f"50% pool ({kind}) speedup >= 0.95x ideal traffic ratio", name,
                         ", ".join(f"B={b}: {r:.2f}" for b, r in ratios) + (" (noisy)" if noisy else ""),
                         "n/a" if noisy else "yes" if worst >= 0.95 else "no"))
    if name != "synthetic" and any(isinstance(b, int) for b in hf):
        rows.append(hf_goal(name, hf, by))
    return rows


def hf_goal(name: str, hf: dict, by: dict, batch: int = HF_GOAL_BATCH) -> tuple:
    """The "engine >= 1.5x transformers" goal scored at the batch it names, or "n/a" where that batch was
    not run through both (another batch's ratio is not that goal's measurement)."""
    goal = f"engine >= 1.5x transformers at batch {batch}"
    if batch not in hf or batch not in by:
        return goal, name, f"batch {batch} not measured", "n/a"
    full = by[batch]["full"].result
    ratio = hf[batch] / full.step_s
    return goal, name, flagged(f"B={batch}: {ratio:.2f}x", full), "n/a" if full.noisy else "yes" if ratio >= 1.5 else "no"


def _json(measured: list[Measured], hf: dict[int, float]) -> dict:
    return {"cells": [{"pool": m.pool.label, "kind": m.pool.kind, "keep": m.pool.keep, "experts": m.pool.experts,
                       "top_k": m.pool.top_k, "batch": m.result.batch, "step_s": m.result.step_s,
                       "tokens_per_s": m.result.tokens_per_s, "distinct": m.result.distinct,
                       "formula": expected_distinct(m.pool.experts, m.pool.top_k, m.result.batch),
                       "expert_bytes": m.result.expert_bytes, "total_bytes": m.result.total_bytes,
                       "bandwidth": m.result.bandwidth, "spread": m.result.spread, "noisy": m.result.noisy}
                      for m in measured],
            "transformers_step_s": {str(k): v for k, v in hf.items()}}
