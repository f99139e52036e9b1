"""Long-context key-value lookup: a table prompt and a one-digit answer (prefill-heavy).

Each line is a single-letter key right before its digit value (``e9``), so retrieval is the one-hop
copy an induction head does; the completion repeats the matching line, then the answer (the answer
alone, or the value three tokens after its key, was not learned). The query's key has a leading space
(``find e``, token ``Ġe``), a different token from the table's, so the look-back has one match.
"""
from __future__ import annotations

import random
import string

from .base import Example, make_example


def generate(rng: random.Random, difficulty: int) -> Example:
    keys = rng.sample(string.ascii_lowercase, 8 * difficulty)   # single-token keys
    values = {k: rng.randrange(10) for k in keys}
    target = rng.choice(keys)
    table = "\n".join(f"{k}{values[k]}" for k in keys)
    prompt = f"lookup\n{table}\nfind {target}\n"
    return make_example("lookup", difficulty, prompt, [f"{target}{values[target]}"], str(values[target]))
