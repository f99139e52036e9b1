"""Tables, plots and the results page written from an evaluation's results dict.

Everything here reads only ``results.json`` content, so a report can be rebuilt without
re-running the sweep. Findings are computed from the numbers (never written by hand), and a
``<!-- notes -->`` ... ``<!-- /notes -->`` block in an existing results page survives a rewrite.
"""
from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

from ..outputs import save_figure, write_text
from ..tables import markdown_table
from .configurations import PHASE_CONFIGURATIONS

PLOTS = ("accuracy_vs_keep.png", "length_by_configuration.png", "length_distribution.png")
HIST_BINS = 20  # length / max_tokens in [0, 1], 20 bins (a budget hit lands in the last)
NOTES_OPEN, NOTES_CLOSE = "<!-- notes -->", "<!-- /notes -->"


def _pct(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _num(x: float, digits: int = 1) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def accuracy_spread(row: dict) -> str:
    """A row's accuracy spread over seeds as printed: "n/a" where one seed ran (no spread was measured;
    its 0.0 standard deviation would read as a perfectly stable figure)."""
    if len(row.get("accuracy_per_seed") or ()) < 2:
        return "n/a"
    return _pct(row["accuracy_std"])


def _order(row: dict) -> tuple:
    config = row["configuration"]
    rank = PHASE_CONFIGURATIONS.index(config) if config in PHASE_CONFIGURATIONS else len(PHASE_CONFIGURATIONS)
    data = (row.get("calibration") or {}).get("data") or ""
    return (row["keep"] is not None, -(row["keep"] or 0), str(row["criterion"] or ""), rank, config, data)


def _rows(results: dict, sampling: str, task: str = "all") -> list[dict]:
    return sorted((r for r in results["rows"] if r["sampling"] == sampling and r["task"] == task), key=_order)


def versus_full_columns(results: dict) -> list[str]:
    """The columns of the paired comparison with the baseline (a run with the baseline configuration),
    and of the floor verdict where ``--floor`` was given."""
    if not any(r.get("vs_full") for r in results["rows"]):
        return []
    floor = results["settings"].get("floor")
    return ["of full (95% CI)", "vs full (p)", *([f"floor {100 * floor:g}%"] if floor is not None else [])]


def versus_full_cells(row: dict, columns: list[str]) -> tuple[str, ...]:
    """'98.4% (97.2-99.5)', '+11/-28 (0.0098)' and the verdict of one row ('–' for the baseline itself)."""
    v = row.get("vs_full")
    if not columns:
        return ()
    if v is None:
        return ("–",) * len(columns)
    share = ("undefined (the full model answers none)" if v["ratio"] is None else
             f"{100 * v['ratio']:.1f}% ({100 * v['low']:.1f}-{100 * v['high']:.1f})")
    cells = (share, f"+{v['gained']}/-{v['lost']} ({v['sign_p']:.2g})")
    if "verdict" in v:
        more = f" (about {v['prompts_to_decide']:,} prompts would decide)" if v.get("prompts_to_decide") else ""
        cells += (v["verdict"] + more,)
    return cells


def summary_table(results: dict, sampling: str) -> str:
    versus = versus_full_columns(results)
    cols = ["criterion", "keep", "configuration", "accuracy % (±std)", *versus, "p50 len", "p90 len", "budget hit %",
            "EOS %", "KL (nats)", "ppl"]
    rows = [(r["criterion"] or "–", "–" if r["keep"] is None else f"{r['keep']:.0%}", r["configuration"],
             f"{_pct(r['accuracy'])} ± {accuracy_spread(r)}", *versus_full_cells(r, versus), _num(r["p50"], 0),
             _num(r["p90"], 0), _pct(r["budget_hit"]), _pct(r["eos"]), _num(r["kl"], 4), _num(r["perplexity"], 2))
            for r in _rows(results, sampling)]
    if len({c["data"] for c in calibrations(results)}) > 1:   # a data= sweep: the domain tells its rows apart
        cols.insert(3, "calibrated on")
        rows = [(*row[:3], (r.get("calibration") or {}).get("data") or "–", *row[3:])
                for row, r in zip(rows, _rows(results, sampling))]
    return markdown_table(cols, rows)


def per_task_table(results: dict, sampling: str) -> str:
    """Per task: accuracy %, and p90 length / budget-hit % (the two ways pruning fails)."""
    tasks = results["settings"]["tasks"]
    by = {(r["variant"], r["task"]): r for r in results["rows"] if r["sampling"] == sampling}
    out = [(r["variant"], *[f"{_pct(by[r['variant'], t]['accuracy'])} · {_num(by[r['variant'], t]['p90'], 0)}/"
                            f"{_pct(by[r['variant'], t]['budget_hit'])}" for t in tasks])
           for r in _rows(results, sampling)]
    budgets = results["settings"]["max_tokens"]
    return markdown_table(["variant", *[f"{t} (max {budgets[t]})" for t in tasks]], out)


def calibrations(results: dict) -> list[dict]:
    """The distinct calibration records behind an evaluation's plans, in row order."""
    seen = {}
    for r in results["rows"]:
        c = r.get("calibration")
        if c and c.get("data") is not None:
            seen.setdefault((c.get("data"), c.get("sha256")), c)
    return list(seen.values())


def cross_domain_table(results: dict, sampling: str) -> str | None:
    """Rows: plans (criterion, keep, configuration) per calibration data; columns: accuracy % on each
    evaluation task, all tasks, and held-out text KL. None when all plans share one calibration."""
    if len({c["data"] for c in calibrations(results)}) < 2:
        return None
    tasks = results["settings"]["tasks"]
    by = {(r["variant"], r["task"]): r for r in results["rows"] if r["sampling"] == sampling}
    rows = []
    for r in sorted(_rows(results, sampling), key=lambda r: (r["keep"] is not None, -(r["keep"] or 0),
                                                             str(r["criterion"] or ""), r["configuration"])):
        data = (r.get("calibration") or {}).get("data") or "–"
        name = r["configuration"] if r["criterion"] is None else f"{r['criterion']} {r['keep']:.0%} {r['configuration']}"
        rows.append((name, data, *[_pct(by[r["variant"], t]["accuracy"]) for t in tasks], _pct(r["accuracy"]),
                     _num(r["kl"], 4)))
    return markdown_table(["plan", "calibrated on", *tasks, "all tasks", "held-out text KL"], rows)


def findings(results: dict, sampling: str) -> list[str]:
    """Plain sentences computed from the numbers: the questions SlimWise asks of every model."""
    rows = _rows(results, sampling)
    base = next((r for r in rows if r["configuration"] == "baseline"), None)
    by_plan: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["keep"] is not None or r["criterion"] is not None:
            by_plan.setdefault((r["criterion"], r["keep"]), {})[r["configuration"]] = r
    out = []
    pairs = [(k, v["phase-aware"], v["pruned"]) for k, v in by_plan.items() if {"phase-aware", "pruned"} <= set(v)]
    if pairs:
        wins = [k for k, pa, pr in pairs if pa["accuracy"] > pr["accuracy"]]
        ties = [k for k, pa, pr in pairs if pa["accuracy"] == pr["accuracy"]]
        diff = sum(pa["accuracy"] - pr["accuracy"] for _, pa, pr in pairs) / len(pairs)
        out.append(f"Phase-aware beats Pruned on accuracy in {len(wins)} of {len(pairs)} plans "
                   f"({len(ties)} ties); mean difference {100 * diff:+.1f} points.")
    if base is not None:
        rev = [v["reverse"] for v in by_plan.values() if "reverse" in v]
        if rev:
            shorter = [r for r in rev if r["p50"] < base["p50"]]
            mean_p50 = sum(r["p50"] for r in rev) / len(rev)
            mean_eos = sum(r["eos"] for r in rev) / len(rev)
            out.append(f"Reverse (pruned prefill, full decode): median length below Baseline's ({base['p50']:.0f} "
                       f"tokens) in {len(shorter)} of {len(rev)} plans (mean p50 {mean_p50:.1f}); EOS share "
                       f"{100 * mean_eos:.1f}% vs Baseline {100 * base['eos']:.1f}%.")
        for config in ("pruned", "phase-aware"):
            rs = [v[config] for v in by_plan.values() if config in v]
            if rs:
                hit = sum(r["budget_hit"] for r in rs) / len(rs)
                p90 = sum(r["p90"] for r in rs) / len(rs)
                out.append(f"{config.capitalize()}: mean budget-hit share {100 * hit:.1f}% (Baseline "
                           f"{100 * base['budget_hit']:.1f}%), mean p90 length {p90:.1f} (Baseline {base['p90']:.0f}).")
        collapsed = [r for r in rows if r["configuration"] != "baseline" and _collapsed(r, base)]
        rule = (f"accuracy below half of Baseline's {_pct(base['accuracy'])}%, or over half the generations hitting "
                f"the budget and 25+ points more than Baseline's {_pct(base['budget_hit'])}%")
        if collapsed:
            names = ", ".join(f"{r['variant']} ({_pct(r['accuracy'])}%, hit {_pct(r['budget_hit'])}%)" for r in collapsed)
            out.append(f"Collapsed ({rule}): {names}.")
        else:
            out.append(f"No configuration collapsed ({rule}).")
        crit = {}
        for (c, _), v in by_plan.items():
            if "pruned" in v:
                crit.setdefault(c, []).append(v["pruned"]["accuracy"])
        if len(crit) > 1:
            means = sorted(((sum(a) / len(a), c) for c, a in crit.items()))
            out.append("Pruned accuracy by criterion (mean over keep ratios): "
                       + ", ".join(f"{c} {100 * m:.1f}%" for m, c in reversed(means)) + ".")
    return out


def _collapsed(row: dict, base: dict) -> bool:
    worse_accuracy = base["accuracy"] > 0 and row["accuracy"] < 0.5 * base["accuracy"]
    runaway = row["budget_hit"] > 0.5 and row["budget_hit"] >= base["budget_hit"] + 0.25
    return worse_accuracy or runaway


def plot(results: dict, out: Path, sampling: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = _rows(results, sampling)
    base = next((r for r in rows if r["configuration"] == "baseline"), None)
    plans = sorted({(r["criterion"], r["keep"]) for r in rows if r["configuration"] != "baseline"},
                   key=lambda p: (str(p[0]), -(p[1] or 0)))
    criteria = sorted({c for c, _ in plans}, key=str) or [None]
    keeps = sorted({k for _, k in plans if k is not None}, reverse=True) or [None]
    configs = [c for c in dict.fromkeys(r["configuration"] for r in rows) if c != "baseline"]

    def save(fig, axes, title: str, name: str) -> Path:
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        save_figure(fig, out / name, dpi=100)
        plt.close(fig)
        return out / name

    def panels(shown, **share):
        """A panel per (criterion, keep), each with Baseline and its plan's rows of ``shown``."""
        fig, axes = plt.subplots(len(criteria), len(keeps), figsize=(3.4 * len(keeps), 2.6 * len(criteria)),
                                 squeeze=False, **share)
        cells = []
        for i, crit in enumerate(criteria):
            for j, keep in enumerate(keeps):
                axes[i][j].set_title(f"{crit} keep {keep:.0%}" if keep is not None else str(crit), fontsize=9)
                mine = [r for r in rows if r["criterion"] == crit and r["keep"] == keep]
                cells.append((axes[i][j], ([base] if base else []) + [r for r in mine if r["configuration"] in shown]))
        return fig, axes, cells

    # 1. accuracy vs keep ratio, one panel per criterion
    fig, axes = plt.subplots(1, len(criteria), figsize=(3.6 * len(criteria), 3.2), squeeze=False, sharey=True)
    for ax, crit in zip(axes[0], criteria):
        for config in configs:
            pts = sorted(((r["keep"], r["accuracy"], r["accuracy_std"]) for r in rows
                          if r["criterion"] == crit and r["configuration"] == config and r["keep"] is not None))
            if pts:
                if base is not None:  # every configuration starts from the full model at keep 1.0
                    pts.append((1.0, base["accuracy"], base["accuracy_std"]))
                x, y, e = zip(*pts)
                ax.errorbar(x, [100 * v for v in y], yerr=[100 * v for v in e], marker="o", capsize=3, label=config)
        if base is not None:
            ax.axhline(100 * base["accuracy"], color="k", ls="--", lw=1, label="baseline")
        ax.set_title(str(crit))
        ax.set_xlabel("share of experts kept")
        ax.set_xlim(1.05, 0.0)
        ax.set_ylim(-3, 103)
    axes[0][0].set_ylabel("exact-match accuracy %")
    written = [save(fig, axes, f"accuracy vs keep ratio ({sampling})", PLOTS[0])]

    # 2. p50 / p90 length per configuration, a panel per (criterion, keep)
    fig, axes, cells = panels(configs, sharey=True)
    for ax, shown in cells:
        x = np.arange(len(shown))
        ax.bar(x - 0.2, [r["p50"] for r in shown], 0.4, label="p50")
        ax.bar(x + 0.2, [r["p90"] for r in shown], 0.4, label="p90")
        ax.set_xticks(x, [r["configuration"] for r in shown], rotation=30, fontsize=7)
    for row in axes:
        row[0].set_ylabel("tokens")
    written.append(save(fig, axes, f"output length, all tasks ({sampling})", PLOTS[1]))

    # 3. length distribution (as a share of each task's budget): Baseline vs Phase-aware vs Reverse
    hist = results.get("histograms", {})
    edges = np.linspace(0, 1, HIST_BINS + 1)
    fig, axes, cells = panels(("phase-aware", "reverse"), sharex=True)
    for ax, shown in cells:
        for r in shown:
            counts = np.asarray(hist.get(r["variant"], {}).get(sampling, [0] * HIST_BINS), dtype=float)
            if counts.sum():
                ax.stairs(counts / counts.sum(), edges, label=r["configuration"], lw=1.4)
        ax.set_xlabel("length / max new tokens", fontsize=8)
    written.append(save(fig, axes, f"length distribution ({sampling})\nlast bin = budget hits", PLOTS[2]))
    return written


def markdown(results: dict, plot_dir: str = ".") -> str:
    s = results["settings"]
    parts = [f"Model `{results['model']['name']}` ({results['model']['model_type']}, {results['model']['num_experts']} "
             f"experts top-{results['model']['top_k']}, router hash `{results['model']['router_hash']}`); "
             f"tasks {', '.join(s['tasks'])}; {s['n']} prompts per task and seed; seeds {s['seeds']}; "
             f"held-out KL/perplexity on {s['heldout']['tokens_scored']} tokens.", ""]
    from ..calibration.calibrate import describe_calibration
    cals = calibrations(results)
    if cals:
        parts += ["Plans calibrated on: " + "; ".join(describe_calibration(c) for c in cals) + ".", ""]
    if versus_full_columns(results):
        parts += ["\"of full\": a configuration's accuracy over the baseline's on the same prompts, with the paired "
                  "95% score interval; \"vs full\": prompts it answers and the baseline does not (+) and the reverse "
                  "(-), with the two-sided exact sign test; a greedy prompt that comes again in another seed counts "
                  "once" + (f"; \"floor\": whether the interval lies above {100 * s['floor']:g}% (meets), below it "
                            "(misses) or straddles it" if s.get("floor") is not None else "") + ".", ""]
    for mode in s["sampling"]:
        label = "greedy" if mode == "greedy" else f"sampling T={s['temperature']}, top-p={s['top_p']}"
        matrix = cross_domain_table(results, mode)
        if matrix:
            parts += [f"### Cross-domain, {label}: accuracy % per evaluation task, by calibration data", "",
                      matrix, ""]
        parts += [f"### All tasks, {label}", "", summary_table(results, mode), "",
                  f"### Per task, {label}: accuracy % · p90 length / budget-hit %", "",
                  per_task_table(results, mode), "", "Findings:", ""]
        parts += [f"- {f}" for f in findings(results, mode)] + [""]
    parts += [f"![accuracy vs keep ratio]({plot_dir}/{PLOTS[0]})", "",
              f"![length per configuration]({plot_dir}/{PLOTS[1]})", "",
              f"![length distribution]({plot_dir}/{PLOTS[2]})", ""]
    return "\n".join(parts)


def write_report(results: dict, out: Path) -> None:
    """results.md and the plots in the output directory."""
    plot(results, out, results["settings"]["sampling"][0])
    write_text(out / "results.md", f"# moetailor eval\n\nCommand: `{results['command']}`\n\n" + markdown(results))


def write_docs(results: dict, out: Path, docs: Path, elapsed_s: float) -> Path:
    """The results page (e.g. docs/results.md), its plots copied beside it under docs/results/."""
    docs = Path(docs)
    plot_dir = docs.parent / docs.stem
    plot_dir.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:
        if (out / name).exists():
            shutil.copy(out / name, plot_dir / name)
    notes = ""
    if docs.exists():
        m = re.search(re.escape(NOTES_OPEN) + r".*?" + re.escape(NOTES_CLOSE), docs.read_text(), re.S)
        notes = m.group(0) if m else ""
    s, t, v = results["settings"], results["timing"], results["versions"]
    tok_s = t["generated_tokens_all_cells"] / max(t["generation_s_all_cells"], 1e-9)
    head = [
        "# Results: expert budgets on the reference model", "",
        "Regenerate (the whole page, tables and plots) with:", "", "```", results["command"], "```", "",
        f"This run took {elapsed_s / 60:.1f} minutes on this 2-core CPU machine ({t['computed_cells']} cells computed, "
        f"{t['cached_cells']} reused from an earlier interrupted run); generation produced "
        f"{t['generated_tokens_all_cells']:,} tokens in {t['generation_s_all_cells']:.0f} s of engine time "
        f"({tok_s:.0f} tok/s); on a machine shared with other jobs the time is an upper bound. The "
        "numbers move by several points between seeds at this size, so read differences of a few points as noise.",
        "",
        f"Versions: moetailor {v['moetailor']}, torch {v['torch']}, transformers {v['transformers']}. "
        f"Max new tokens per task ({s['budget_rule']}): "
        + ", ".join(f"{k} {n}" for k, n in s["max_tokens"].items()) + ".", "",
        "Configurations (SlimWise Table 3): baseline = full prefill + full decode; pruned = the plan in both "
        "phases; reverse = pruned prefill + full decode; phase-aware = full prefill + pruned decode. "
        "KL is the mean next-token KL(full || configuration) on held-out text whose first half ran under the "
        "configuration's prefill policy and whose second half (where KL is measured) ran under its decode policy.",
        "",
    ]
    if notes:
        head += [notes, ""]
    write_text(docs, "\n".join(head) + markdown(results, plot_dir=plot_dir.name))
    return docs
