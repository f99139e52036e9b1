"""Reversing or copying a string of letters (letters space-separated so each is one token)."""
from __future__ import annotations

import random
import string

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    letters = [rng.choice(string.ascii_lowercase) for _ in range(2 * difficulty + 2)]
    mode = rng.choice(["reverse", "copy"])
    out = letters[::-1] if mode == "reverse" else letters
    return make_example("reverse", difficulty, f"{mode} {' '.join(letters)}\n", [], " ".join(out))
