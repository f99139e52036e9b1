"""Incremental detokenization and stop strings: each update decodes only the newest tokens, with
the token before them (a tokenizer may render a token differently at the start of a string); a
window ending inside a multi-byte character waits. A finished sequence is decoded once in full and
cut at the first stop string, so the final text never depends on how it was streamed.
"""
from __future__ import annotations

from .sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def resume(self, seq: Sequence) -> None:
        """A sequence that arrives with completion tokens (prefilled elsewhere): its text so far,
        decoded once; the next ``update`` starts after them."""
        seq.text = self._decode(seq.completion_token_ids)
        seq.detok_prefix = seq.detok_read = seq.num_completion_tokens
        seq.detokenizer = self

    def update(self, seq: Sequence) -> bool:
        """Extend ``seq.text`` by its new tokens; True when a stop string has appeared."""
        ids, start = seq.token_ids, seq.num_prompt_tokens
        prefix = self._decode(ids[start + seq.detok_prefix:start + seq.detok_read])
        window = self._decode(ids[start + seq.detok_prefix:])
        before, new = len(seq._text), window[len(prefix):]
        if new.endswith("\ufffd"):   # an incomplete UTF-8 sequence: keep the window open for the next token
            text = seq._text + new.rstrip("\ufffd")
        else:
            text = seq._text = seq._text + new
            seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids) - start
        stops = seq.sampling.stop
        if not stops:
            return False
        longest = max(map(len, stops))
        return any(text.find(s, max(0, before - longest + 1)) >= 0 for s in stops)

    def finalize(self, seq: Sequence) -> None:
        """The exact text of the completion, cut at the first stop string."""
        text = self._decode(seq.completion_token_ids)
        cut = min((i for i in (text.find(s) for s in seq.sampling.stop) if i >= 0), default=-1)
        seq.text = text[:cut] if cut >= 0 else text
        seq.detok_prefix = seq.detok_read = seq.num_completion_tokens
