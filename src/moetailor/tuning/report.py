"""What `tune` writes and prints: the front table, front.json (evidence per point), front.md, front.png."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..outputs import write_json

# The search calls write_report with itself and its result (search.Tuner, search.TuneResult); they are
# not imported here, even for type checking, so the two modules do not import each other.


def _public(r: dict) -> dict:
    """A point's evidence without the per-prompt list (kept in its candidate file)."""
    out = {k: v for k, v in r.items() if k not in ("identity", "tasks", "fresh_tasks")}
    for key in ("tasks", "fresh_tasks"):
        if key in r:
            out[key] = {k: v for k, v in r[key].items() if k not in ("correct", "identity")}
    return out


def _of_full(r: dict) -> str:
    """'101.9% [91.6-119.3]': the share of the full model's accuracy and its paired 95% interval."""
    if r.get("of_full") is None:
        return "-"
    v = r.get("floor")
    if not v or v["low"] is None or v["low"] != v["low"] or (v["low"] == v["high"] == 1.0):
        return f"{100 * r['of_full']:.1f}%"
    return f"{100 * r['of_full']:.1f}% [{100 * v['low']:.1f}-{100 * v['high']:.1f}]"


def rows(tuner, result, points: list[dict]) -> tuple[list[str], list[tuple]]:
    """The front table: one row per point."""
    speed = tuner.s.min_tok_s is not None
    # --backend vllm (which needs --servable vllm: every row runs on vLLM) says instead which engine scored
    # each row: vLLM, or the embedded engine for a merged decoder
    where = tuner.s.backend != "engine"
    # the plans the choice names also ran fresh prompts (search.Tuner._confirm); their floor verdict is that set's
    fresh = any(r.get("fresh") for r in points)
    cols = ["plan", "budget", "pool", "KL", "accuracy %", "of full (95% CI)", "vs full (p)",
            "fresh prompts: of full (95% CI)" if fresh else None, "p90",
            "tok/s" if speed else None, "scored on" if where else "vLLM", "floor", "at target"]
    cols = [c for c in cols if c]
    out = []
    for r in points:
        acc = r.get("accuracy")
        vs = r.get("vs_full")
        row = [r["label"], f"{r['budget']:.3f}", f"{r['pool_share']:.3f}", f"{r['kl']:.4f}",
               f"{100 * acc:.1f}" if acc is not None else "-", _of_full(r),
               f"+{vs['gained']}/-{vs['lost']} ({vs['p']:.2g})" if vs else "-"]
        if fresh:
            row.append(_of_full(r["fresh"]) if r.get("fresh") else "-")
        row.append(f"{r['tasks']['p90']:.0f}" if r.get("tasks") else "-")
        if speed:
            row.append(f"{r['tok_s']:.0f}" if r.get("tok_s") is not None else "-")
        scored_on = {"vllm": "vLLM"}.get(r.get("scored_by"), r.get("scored_by") or "-")
        verdict = tuner.floor_verdict(r)    # a named plan's is the fresh prompts'; say where another's comes from
        if fresh and not r.get("fresh") and r.get("floor"):
            verdict += " (first prompts)"
        row += [scored_on if where else "yes" if r.get("vllm") else "no", verdict,
                "yes" if tuner.at_target(r) else "no"]
        out.append(tuple(row))
    return cols, out


def write_report(tuner, result) -> None:
    """front.json (evidence per point), front.md (the table), front.png (the plot)."""
    from ..tables import markdown_table
    from .front import plot_front

    s, out = tuner.s, tuner.out
    target = s.budget if s.min_tok_s is None else s.min_tok_s
    xkey = "tok_s" if s.min_tok_s is not None else "budget"
    choice = result.choice
    data = {"format": "moetailor-tune", "version": 1, "command": s.command,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
            "model": tuner.fp, "quality": result.quality, "summary": result.summary,
            "points": [_public(r) for r in result.points], "front": [r["key"] for r in result.front],
            "choice": {"met": choice.met, "chosen": choice.chosen and choice.chosen["key"],
                       "best_at_target_verdict": choice.best_at_target and tuner.floor_verdict(choice.best_at_target),
                       "cheapest_meeting_floor": choice.cheapest_meeting_floor and choice.cheapest_meeting_floor["key"],
                       "best_at_target": choice.best_at_target and choice.best_at_target["key"],
                       "plan": str(result.plan_path) if result.plan_path else None},
            "proxy": [_public(r) for r in sorted(tuner.scored.values(), key=lambda r: (r["budget"], r["kl"]))]}
    write_json(out / "front.json", data)
    cols, table = rows(tuner, result, result.front)
    from ..outputs import write_text
    write_text(out / "front.md", markdown_table(cols, table) + "\n")
    if result.quality == "accuracy":
        y, ylabel, floor = "of_full", "share of the full model's accuracy", s.min_quality
    else:
        y, ylabel, floor = "kl", "held-out traffic KL (nats/token)", s.max_kl
    pts = [r for r in result.points if r.get(xkey) is not None and r.get(y) is not None]
    front = [r for r in result.front if r.get(xkey) is not None and r.get(y) is not None]
    xlabel = "decode tok/s" if xkey == "tok_s" else f"share of expert weights read per decode step (batch {s.batch})"
    plot_front(pts, sorted(front, key=lambda r: r[xkey]), out / "front.png", xkey, xlabel, y, ylabel,
               f"moetailor tune: {s.model} on {Path(str(s.data)).name}", floor, target)
