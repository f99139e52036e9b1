"""Long-context key-value lookup: a long prompt and a two-digit answer (prefill-heavy).

The completion first repeats the matching table line, then the answer: retrieval becomes a copy
that an induction head can learn (the answer alone, 3 loss tokens per ~150-token example, left
the reference model at 8%). Keys are single letters, one token each: with three-letter keys
(several BPE pieces) the model could not even copy the query key (18% after a third stage).
"""
from __future__ import annotations

import random
import string

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    keys = rng.sample(string.ascii_lowercase, 8 * difficulty)   # single-token keys (see the docstring)
    values = {k: rng.randrange(10, 100) for k in keys}
    target = rng.choice(keys)
    table = "\n".join(f"key {k} = {values[k]}" for k in keys)
    prompt = f"lookup\n{table}\nfind {target}\n"
    return make_example("lookup", difficulty, prompt, [f"key {target} = {values[target]}"], str(values[target]))
