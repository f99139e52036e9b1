"""Long-context key-value lookup: a long prompt and a two-digit answer (prefill-heavy).

    lookup          <- prompt: a table of 8 x difficulty lines "<key><value>", then the query
    c55
    k17
    ...
    find k
    k17             <- completion: the matching line, then the answer
    #### 17

The format is shaped for the circuit a small model can learn in its training budget. Keys are
single letters (one token each) and the value's digits follow the key token directly, so writing
the matching line is a plain induction copy: "the token after the earlier ``k`` is 1". The first
format, ``key k = 17``, put two tokens between key and value; the reference model copied the key
but answered with a neighbouring line's value (10% after 2,400 steps).
"""
from __future__ import annotations

import random
import string

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    keys = rng.sample(string.ascii_lowercase, 8 * difficulty)   # single-token keys (see the docstring)
    values = {k: rng.randrange(10, 100) for k in keys}
    target = rng.choice(keys)
    table = "\n".join(f"{k}{values[k]}" for k in keys)
    prompt = f"lookup\n{table}\nfind {target}\n"
    return make_example("lookup", difficulty, prompt, [f"{target}{values[target]}"], str(values[target]))
