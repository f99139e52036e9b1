"""Long-context key-value lookup: a long table in the prompt, a few one-digit answers (prefill-heavy).

    lookup          <- prompt: a table of 8 x difficulty lines "<key><value>", then the queries
    c5
    k1
    ...
    find k c
    k1              <- completion: the matching line per query, then the answers
    c5
    #### 1 5

The format is shaped for the circuit a small model can learn in its training budget. Keys are
single letters and values single digits, one token each, and the value follows its key directly,
so each answer line is a one-hop induction copy: "the token after the earlier ``k`` is 1".
Two-digit values (``k17``) need the second digit matched on the pair ``k1`` (digits repeat across
lines); a model trained 250 steps on that format alone still scored 0%. One query per example
gave two supervised copy tokens per ~100-token table; ``difficulty + 1`` queries give more
signal per table, grow the answer with difficulty, and put chance level at 10^-(difficulty+1).
"""
from __future__ import annotations

import random
import string

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    keys = rng.sample(string.ascii_lowercase, 8 * difficulty)   # single-token keys (see the docstring)
    values = {k: rng.randrange(10) for k in keys}
    queries = rng.sample(keys, difficulty + 1)
    table = "\n".join(f"{k}{values[k]}" for k in keys)
    prompt = f"lookup\n{table}\nfind {' '.join(queries)}\n"
    return make_example("lookup", difficulty, prompt, [f"{q}{values[q]}" for q in queries],
                        " ".join(str(values[q]) for q in queries))
