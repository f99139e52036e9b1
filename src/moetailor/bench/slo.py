"""`moetailor bench slo`: machine throughput against per-user speed as the batch grows (SlimWise
Figure 4), for the full and pruned pools, colocated and disaggregated, and the throughput each
reaches at a per-user SLO. Per-user tokens/s = 1 / step time; machine tokens/s = batch / step time.
"""
from __future__ import annotations

from pathlib import Path

from .decode import DecodeConfig, Measured, measure_model, model_names
from .report import Report, close, figure


def throughput_at_slo(points: list[tuple[float, float]], slo: float) -> tuple[float, float] | None:
    """Best machine tokens/s among (per-user tok/s, machine tok/s) points meeting the SLO, each
    segment from a point that meets it to the next (larger-batch) point that misses it interpolated
    to the SLO. Points are ordered by machine tok/s (= batch order), not by per-user speed: measured
    per-user speeds are noisy and need not fall monotonically with the batch."""
    points = sorted(points, key=lambda p: p[1])
    best = None
    for (u1, t1), nxt in zip(points, points[1:] + [None]):
        if u1 < slo:
            continue
        candidate = (u1, t1)
        if nxt is not None and nxt[0] < slo:
            u2, t2 = nxt
            candidate = (slo, max(t1, t1 + (t2 - t1) * (u1 - slo) / (u1 - u2)))
        if best is None or candidate[1] > best[1]:
            best = candidate
    return best


def run_slo(model: str, batches: list[int], keeps: list[float], slo: float | None, steps: int | None, quick: bool,
            synthetic_layers: int, pruned: bool, out: Path, command: str = "") -> Report:
    cfg = DecodeConfig(model, batches, keeps, [], steps, quick, synthetic_layers, hf=False, pruned=pruned).resolved()
    if quick:  # the curve needs several batches even in quick mode
        cfg.batches = [b for b in batches if b in (1, 4, 16, 64)] or batches
    rep = Report("SLO: decode throughput vs per-user speed", out, command)
    rep.data = {"models": {}}
    for name in model_names(model):
        measured, _ = measure_model(name, cfg, progress_desc="slo")
        _report_model(rep, name, measured, slo)
    return rep


def _report_model(rep: Report, name: str, measured: list[Measured], slo: float | None) -> None:
    labels = list(dict.fromkeys(m.pool.label for m in measured))
    curves = {l: [(1 / m.result.step_s, m.result.tokens_per_s, m.result.batch) for m in measured if m.pool.label == l]
              for l in labels}
    if slo is None:
        full = {b: u for u, _, b in curves["full"]}
        slo = round(full.get(8, min(full.values())), 1)
        rep.note(f"{name}: no --slo given; using the full pool's per-user speed at batch "
                 f"{8 if 8 in full else max(full)}: {slo} tok/s per user.")
    rows = []
    full_at = throughput_at_slo([(u, t) for u, t, _ in curves["full"]], slo)
    for l, pts in curves.items():
        at = throughput_at_slo([(u, t) for u, t, _ in pts], slo)
        mode = {"full": "-", "mask": "colocated", "pruned": "disaggregated"}.get(l.split()[0], "-")
        ratio = f"{at[1] / full_at[1]:.2f}x" if at and full_at else "-"
        rows.append((l, mode, ", ".join(f"B={b}: {u:.1f}/{t:.0f}" for u, t, b in pts),
                     f"{at[1]:.0f}" if at else "misses SLO", ratio))
    rep.table(f"{name}: per-user tok/s / machine tok/s by batch, and throughput at {slo:g} tok/s per user",
              ["pool", "mode", "curve (per-user / machine)", f"tok/s at SLO {slo:g}", "vs full"], rows)
    rep.data.setdefault("models", {})[name] = {"slo": slo, "curves": {l: [{"per_user": u, "throughput": t, "batch": b}
                                                           for u, t, b in pts] for l, pts in curves.items()}}
    fig, ax = figure("per-user tok/s", "machine decode tok/s", f"{name}: SLO curves (batch grows right to left)")
    for i, (l, pts) in enumerate(curves.items()):
        ax.plot([u for u, _, _ in pts], [t for _, t, _ in pts], marker="o", ms=3,
                ls="--" if l.startswith("pruned") else "-", color=f"C{i}", label=l)
    ax.axvline(slo, color="grey", ls=":", lw=1, label=f"SLO {slo:g}")
    ax.legend(fontsize=8)
    rep.plot(f"{name}_slo.png", fig)
    close(fig)
