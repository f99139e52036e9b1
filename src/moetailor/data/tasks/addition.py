"""Multi-digit addition, one line per digit with its carry and the result so far."""
from __future__ import annotations

import random

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    digits = difficulty + 1  # difficulty 1 -> 2-digit operands
    a = rng.randrange(10 ** (digits - 1), 10**digits)
    b = rng.randrange(10 ** max(0, digits - 2), 10**digits)
    return solve(a, b, difficulty)


def solve(a: int, b: int, difficulty: int = 0) -> Example:
    da, db = str(a)[::-1], str(b)[::-1]
    carry, result, trace = 0, "", []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        result = str(s % 10) + result
        trace.append(f"{x}+{y}+{carry}={s} c{s // 10} | {result}")
        carry = s // 10
    if carry:
        result = "1" + result
        trace.append(f"carry 1 | {result}")
    assert int(result) == a + b
    return make_example("addition", difficulty, f"add {a} + {b}\n", trace, result)
