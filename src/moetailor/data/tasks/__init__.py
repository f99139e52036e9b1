"""The verifiable task suite: seeded generators with exact-match scoring.

Training and evaluation draw from disjoint seed streams (``training_rng`` vs ``eval_rng``), so no
evaluation prompt is generated from a seed the reference model was trained on.
"""
from __future__ import annotations

import random

from ...tables import unknown_choice
from . import addition, brackets, expressions, lookup, reverse, sorting
from .base import ANSWER_MARKER, Example, Task, extract_answer, score

TASKS: dict[str, Task] = {
    "addition": Task("addition", addition.generate, (1, 2, 3), "multi-digit addition, a line per digit"),
    "expressions": Task("expressions", expressions.generate, (1, 2, 3), "nested expressions reduced a step per line"),
    "brackets": Task("brackets", brackets.generate, (1, 2, 3), "bracket balancing with a stack trace"),
    "sorting": Task("sorting", sorting.generate, (1, 2, 3), "sorting integers"),
    "reverse": Task("reverse", reverse.generate, (1, 2, 3), "reversing / copying letters"),
    "lookup": Task("lookup", lookup.generate, (1, 2, 3), "long-context key-value lookup"),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(unknown_choice("task", name, [*TASKS, "all"]))
    return TASKS[name]


def training_rng(seed: int) -> random.Random:
    return random.Random(f"train:{seed}")


def eval_rng(task: str, seed: int) -> random.Random:
    return random.Random(f"eval:{task}:{seed}")


def eval_examples(task: Task, n: int, seed: int = 0, difficulties: tuple[int, ...] | None = None) -> list[Example]:
    """n held-out examples, cycling over the task's trained difficulties."""
    rng = eval_rng(task.name, seed)
    levels = difficulties or task.difficulties
    return [task.generate(rng, levels[i % len(levels)]) for i in range(n)]


__all__ = ["ANSWER_MARKER", "Example", "Task", "TASKS", "get_task", "score",
           "extract_answer", "training_rng", "eval_rng", "eval_examples"]
