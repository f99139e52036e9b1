"""Pareto fronts, the choice against a quality floor and a target, and the paired sign test.

Whether a point meets an accuracy floor is ``eval.metrics.floor_verdict``'s call (a paired 95%
interval of its share of the full model's accuracy): "meets", "misses" or "not enough prompts to tell".

A point is one evaluated candidate's evidence record (a dict, as written to the output folder):
``budget`` (share of expert weights a decode step reads), ``kl`` (held-out traffic KL), and when
tasks were run ``accuracy`` / ``of_full`` (share of the full model's accuracy) and ``correct`` (per
prompt, for the paired test), ``tok_s`` when a speed target was measured or projected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..eval.metrics import PairedCounts, sign_test


def pareto(points: list[dict], cost: Callable[[dict], float], quality: Callable[[dict], float]) -> list[dict]:
    """The points no other point beats on both cost (lower) and quality (higher), cheapest first."""
    out, best = [], -math.inf
    for p in sorted(points, key=lambda p: (cost(p), -quality(p))):
        if quality(p) > best + 1e-12:
            out.append(p)
            best = quality(p)
    return out


def paired(correct: list[bool], reference: list[bool]) -> tuple[int, int, float]:
    """(prompts this run answers and the reference does not, the reverse, sign-test p)."""
    c = PairedCounts.of(correct, reference)
    return c.gained, c.lost, sign_test(c.gained, c.lost)


@dataclass
class Choice:
    chosen: dict | None                   # proven to meet the floor at the target (best quality there)
    cheapest_meeting_floor: dict | None   # lowest budget among the points proven to meet the floor
    best_at_target: dict | None           # best quality among the points at the target, whatever its verdict
    quality_name: str

    @property
    def met(self) -> bool:
        return self.chosen is not None


def choose(points: list[dict], verdict: Callable[[dict], str], at_target: Callable[[dict], bool],
           quality: Callable[[dict], float], quality_name: str) -> Choice:
    """The plan to serve: among points whose floor verdict is "meets" (proven on these prompts, see
    ``eval.metrics.floor_verdict``) and that reach the target, the best quality (ties: the lower budget).
    Whatever the outcome, the best on each side is named too; a point the prompts cannot yet tell
    about is never chosen, only named as the best at the target with its verdict."""
    from ..eval.metrics import MEETS

    floor = [p for p in points if verdict(p) == MEETS]
    target = [p for p in points if at_target(p)]
    both = [p for p in floor if at_target(p)]
    best = lambda ps: max(ps, key=lambda p: (quality(p), -p["budget"])) if ps else None  # noqa: E731
    cheapest = min(floor, key=lambda p: (p["budget"], -quality(p))) if floor else None
    return Choice(best(both), cheapest, best(target), quality_name)


def plot_front(points: list[dict], front: list[dict], path: Path, x: str, xlabel: str, y: str, ylabel: str,
               title: str, floor: float | None = None, target: float | None = None) -> Path:
    """Every evaluated point (grey), the front (line) and the floor/target lines, as a PNG."""
    from ..bench.report import close, figure

    fig, ax = figure(xlabel, ylabel, title)
    xs = [p[x] for p in points if p.get(y) is not None]
    ys = [p[y] for p in points if p.get(y) is not None]
    ax.scatter(xs, ys, s=12, color="0.6", label="evaluated")
    ax.plot([p[x] for p in front], [p[y] for p in front], marker="o", color="C0", label="Pareto front")
    for p in front:
        ax.annotate(p["label"], (p[x], p[y]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if floor is not None:
        ax.axhline(floor, color="C3", ls="--", lw=1, label="quality floor")
    if target is not None:
        ax.axvline(target, color="C2", ls="--", lw=1, label="target")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    close(fig)
    return path
