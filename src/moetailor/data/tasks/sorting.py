"""Sorting a list of integers: one line per extracted minimum, then the sorted list."""
from __future__ import annotations

import random

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    values = [rng.randrange(0, 100) for _ in range(difficulty + 2)]
    return solve(values, difficulty)


def solve(values: list[int], difficulty: int = 0) -> Example:
    ordered = sorted(values)
    trace = [f"min {v}" for v in ordered]
    return make_example("sorting", difficulty, f"sort {' '.join(map(str, values))}\n", trace,
                        " ".join(map(str, ordered)))
