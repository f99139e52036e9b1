"""Shared helpers for the engine tests (imported by name: tests/engine is on sys.path)."""
from __future__ import annotations

import torch

from moetailor.models.tiny import char_tokenizer  # noqa: F401  (the tests import it from here)


def random_prompts(lengths, vocab=96, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding involved)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=1)
    return out[0, len(prompt):].tolist()
