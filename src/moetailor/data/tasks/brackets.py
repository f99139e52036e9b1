"""Bracket balancing with the stack written after every character; answer yes/no."""
from __future__ import annotations

import random

from .base import Example, make_example

_PAIRS = {")": "(", "]": "[", "}": "{"}


def _balanced(rng: random.Random, n_pairs: int) -> str:
    if n_pairs == 0:
        return ""
    inner = rng.randrange(0, n_pairs)
    o, c = rng.choice(["()", "[]", "{}"])
    return o + _balanced(rng, inner) + c + _balanced(rng, n_pairs - 1 - inner)


def generate(rng: random.Random, difficulty: int) -> Example:
    n_pairs = difficulty + 1
    text = _balanced(rng, n_pairs)
    if rng.random() < 0.5:  # corrupt: swap one bracket for another, or drop one
        chars = list(text)
        i = rng.randrange(len(chars))
        if rng.random() < 0.5:
            chars[i] = rng.choice([c for c in "()[]{}" if c != chars[i]])
        else:
            del chars[i]
        text = "".join(chars)
    return solve(text, difficulty)


def solve(text: str, difficulty: int = 0) -> Example:
    stack: list[str] = []
    trace, answer = [], "yes"
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif stack and stack[-1] == _PAIRS[ch]:
            stack.pop()
        else:
            trace.append(f"{ch} mismatch")
            answer = "no"
            break
        trace.append(f"{ch} {''.join(stack) or '-'}")
    if answer == "yes" and stack:
        trace.append("end open")
        answer = "no"
    return make_example("brackets", difficulty, f"balanced {' '.join(text)}\n", trace, answer)
