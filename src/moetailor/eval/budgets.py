"""Quality per expert budget (MoE-Prism's operating points): a split model's b of N*k sub-experts
against the original's whole-expert top-k at equal active parameters (b = N*j). Both run ``topk:K``
through the ordinary eval sweep and are joined per active fraction; a budget is *usable* within
``tolerance`` of that model's full budget.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..outputs import save_figure, write_json, write_text
from ..tables import markdown_table


def parse_budgets(spec: str, max_budget: int) -> list[int]:
    """'all' -> 1..max_budget; '4,8,16' -> those, checked against the model's range."""
    if spec == "all":
        return list(range(1, max_budget + 1))
    try:
        budgets = sorted({int(b) for b in spec.split(",")})
    except ValueError:
        raise ValueError(f"--budgets {spec!r} must be 'all' or comma-separated integers, e.g. 4,8,16,32") from None
    bad = [b for b in budgets if not 1 <= b <= max_budget]
    if bad:
        raise ValueError(f"--budgets {bad} out of range: the split model routes 1..{max_budget} sub-experts per token")
    return budgets


def compare_budgets(settings, split_dir: str, original: str, budgets_spec: str, out: Path,
                    tolerance: float = 0.05, log=print, overwrite: bool = False) -> dict:
    """Run both sweeps (``settings`` supplies tasks, n, seeds; its model and configs are replaced)
    and write budgets.json, budgets.md and budgets.png to ``out``."""
    from ..models import load_model, moe_layers
    from ..transforms.split import read_split_sidecar
    from .configurations import parse_configs
    from .runner import Sweep

    side = read_split_sidecar(split_dir)
    if side is None:
        raise ValueError(f"{split_dir} is not a split checkpoint (no moetailor split sidecar); --budgets compares a "
                         "model from `moetailor split` with its --original")
    parts = int(side["parts"])
    split_k = moe_layers(load_model(split_dir))[0].top_k
    original_k = moe_layers(load_model(original))[0].top_k
    if split_k != parts * original_k:
        raise ValueError(f"{split_dir} routes {split_k} sub-experts = {parts} parts x {split_k // parts} experts, but "
                         f"--original {original} routes {original_k}: it is not the model this split came from")
    budgets = parse_budgets(budgets_spec, split_k)
    whole = sorted({b // parts for b in budgets if b % parts == 0} | {original_k})
    runs = {}
    for name, model, ks in (("split", split_dir, sorted(set(budgets) | {split_k})), ("original", original, whole)):
        log(f"{name}: topk {ks}")
        cfg = replace(settings, model=model, configs=parse_configs(",".join(f"topk:{k}" for k in ks)),
                      plan=None, sweep=None)
        results = Sweep(cfg, out / name, log=log, overwrite=overwrite).run()
        runs[name] = {int(r["variant"].split(":")[1]): r for r in results["rows"]
                      if r["task"] == "all" and r["sampling"] == cfg.sampling[0]}
    prompts = settings.n * len(settings.tasks) * settings.seeds                     # per budget
    tell = can_tell(prompts, tolerance)
    points = []
    for name, scale in (("split", split_k), ("original", original_k)):
        full = runs[name][scale]["accuracy"]
        for k, r in sorted(runs[name].items()):
            points.append({"model": name, "k": k, "active_fraction": k / scale, "accuracy": r["accuracy"],
                           "accuracy_std": r["accuracy_std"], "p50": r["p50"], "p90": r["p90"],
                           "budget_hit": r["budget_hit"],
                           "usable": r["accuracy"] >= full - tolerance if tell else None})
    usable = {name: sum(bool(p["usable"]) for p in points if p["model"] == name) if tell else None for name in runs}
    result = {"split": split_dir, "original": original, "parts": parts, "tolerance": tolerance, "prompts": prompts,
              "points": points, "usable_points": usable}
    write_json(out / "budgets.json", result, indent=1)
    write_text(out / "budgets.md", budget_table(result) + "\n\n![accuracy per budget](budgets.png)\n")
    _plot(result, out / "budgets.png")
    return result


def can_tell(prompts: int, tolerance: float) -> bool:
    """Whether ``prompts`` per budget resolve a ``tolerance`` on accuracy: the standard error of an
    accuracy near 50% (0.5 / sqrt(prompts)) at most the tolerance (5 points: 100 prompts). With fewer, a
    budget's "usable" mark is a coin toss and no verdict is printed."""
    return prompts > 0 and 0.5 / prompts ** 0.5 <= tolerance


def min_prompts(tolerance: float) -> int:
    """The fewest prompts per budget ``can_tell`` accepts."""
    return next(n for n in range(1, 10**6) if can_tell(n, tolerance))


def budget_rows(result: dict) -> list[tuple]:
    by = {(p["model"], round(p["active_fraction"], 6)): p for p in result["points"]}
    rows = []
    for frac in sorted({round(p["active_fraction"], 6) for p in result["points"]}):
        s, o = by.get(("split", frac)), by.get(("original", frac))
        cell = lambda p: (f"{100 * p['accuracy']:.1f}" + (" *" if p["usable"] else ""), f"{p['p50']:.0f}/{p['p90']:.0f}") \
            if p else ("-", "-")
        rows.append((f"{frac:.3f}", s["k"] if s else "-", *cell(s), o["k"] if o else "-", *cell(o)))
    return rows


def budget_table(result: dict) -> str:
    tol, usable = 100 * result["tolerance"], result["usable_points"]
    if usable["split"] is None or usable["original"] is None:
        verdict = (f"Usable budgets (within {tol:.0f} points of that model's full budget): too few prompts to tell "
                   f"({result.get('prompts', '?')} per budget; a {tol:.0f}-point tolerance needs at least "
                   f"{min_prompts(result['tolerance'])}).\n\n")
    else:
        verdict = (f"* = usable (within {tol:.0f} points of that model's full budget, {result.get('prompts', '?')} "
                   f"prompts per budget): split {usable['split']}, original {usable['original']}.\n\n")
    head = f"Active routed-expert fraction per token; split = {result['parts']} sub-experts per expert. " + verdict
    return head + markdown_table(["active fraction", "split k", "split acc %", "split p50/p90",
                                  "original k", "original acc %", "original p50/p90"], budget_rows(result))


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, marker in (("split", "o"), ("original", "s")):
        pts = [p for p in result["points"] if p["model"] == name]
        ax.plot([p["active_fraction"] for p in pts], [100 * p["accuracy"] for p in pts], marker=marker, label=name)
    ax.set_xlabel("active routed-expert fraction per token")
    ax.set_ylabel("greedy accuracy %")
    ax.set_title(f"accuracy per budget ({result['parts']}-way split vs whole experts)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
