"""`moetailor bench prefill`: prefill throughput per pool. The papers expect it nearly flat:
prefill is compute-bound (every expert sees many tokens), so a smaller pool saves little time."""
from __future__ import annotations

import gc
from pathlib import Path

from .decode import load_bench_model, model_names
from .measure import engine_prefill, make_llm
from .pools import mask_plan, pruned_model
from .report import Report, close, figure


def run_prefill(model: str, keeps: list[float], prompt_len: int, batches: list[int], quick: bool,
                synthetic_layers: int, out: Path, command: str = "") -> Report:
    from tqdm import tqdm

    if quick:
        keeps, batches, prompt_len = keeps[:2], batches[:1], min(prompt_len, 64)
    rep = Report("Prefill: tokens/s per pool", out, command)
    rep.data = {"models": {}}
    for name in model_names(model):
        base = load_bench_model(name, synthetic_layers)
        max_len = prompt_len + 4
        llm = make_llm(base, max(batches), max_len)
        rows, series = [], {}
        bar = tqdm(total=len(batches) * (1 + 2 * len(keeps)), desc=f"{name}: prefill", unit="run")
        full = {}
        for b in batches:
            llm.set_plan(None)
            full[b] = engine_prefill(llm, b, prompt_len, repeats=2 if quick else 3)
            series.setdefault("full", []).append((b, full[b]))
            rows.append(("full", b, b * prompt_len, f"{full[b]:.0f}", "1.00x"))
            bar.update()
        for keep in keeps:
            llm.set_plan(mask_plan(base, keep, phase="prefill"))
            pruned = pruned_model(base, keep)
            pruned_llm = make_llm(pruned, max(batches), max_len)
            for label, engine in ((f"mask {keep:.0%}", llm), (f"pruned {keep:.0%}", pruned_llm)):
                for b in batches:
                    tps = engine_prefill(engine, b, prompt_len, repeats=2 if quick else 3)
                    series.setdefault(label, []).append((b, tps))
                    rows.append((label, b, b * prompt_len, f"{tps:.0f}", f"{tps / full[b]:.2f}x"))
                    bar.update()
            del pruned_llm, pruned
            gc.collect()
        bar.close()
        llm.set_plan(None)
        rep.table(f"{name}: prefill tokens/s ({prompt_len}-token prompts, best of {2 if quick else 3})",
                  ["pool", "batch", "tokens/step", "prefill tok/s", "vs full"], rows)
        rep.data["models"][name] = {l: [{"batch": b, "tokens_per_s": t} for b, t in pts] for l, pts in series.items()}
        fig, ax = figure("pool kept (fraction of experts)", "prefill tok/s", f"{name}: prefill throughput per pool")
        for b in batches:
            ax.plot([1.0, *keeps], [full[b], *(dict(series[f"pruned {keep:.0%}"])[b] for keep in keeps)], marker="o",
                    label=f"batch {b} (pruned)")
        ax.legend(fontsize=8)
        rep.plot(f"{name}_prefill.png", fig)
        close(fig)
        del llm, base
        gc.collect()
    return rep
