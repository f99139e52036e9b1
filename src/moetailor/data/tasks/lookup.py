"""Long-context key-value lookup: a table prompt and a one-digit answer (prefill-heavy).

Each table line is a single-letter key written against its digit value (``e9``: two tokens, the
value right after the key), so retrieval is the one-hop copy an induction head does: "find the
earlier copy of this key, read the token after it". The completion first repeats the matching
line, then the answer. Measured on earlier formats: with the answer alone (3 loss tokens per
~150-token example) the reference model reached 8%; with ``key e = 93`` lines the value sat three
tokens after its key and the model never learned the look-back (10%). The query is written with a
leading space (``find e``, token ``Ġe``), a different token from the table's line-initial key, so
the look-back has exactly one earlier match.
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
