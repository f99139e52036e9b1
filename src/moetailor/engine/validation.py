"""Request checks shared by the colocated engine and the disaggregated front end, so both answer
a bad request with the same ValueError before any worker sees it."""
from __future__ import annotations

from .k_tiers import validate_expert_top_k
from .sampling import SamplingParams

NO_TOKENIZER = ("a text prompt needs a tokenizer and this model folder has no tokenizer files (tokenizer.json / "
                "tokenizer_config.json); copy them into the folder, pass tokenizer=, or send token ids")


def encode_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a text or token-id prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))
    if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
        raise ValueError("a token-id prompt must be a list of integers")
    return None, list(prompt)


def check_request(ids: list[int], sampling: SamplingParams, vocab_size: int, max_model_len: int,
                  budget: tuple[int, int | None] | None = None) -> None:
    """ValueError naming the problem when a request can never run: no tokens, ids outside the
    vocabulary, prompt + max_tokens over the context, an expert budget outside ``budget`` = (max k, parts)."""
    sampling.validate()
    if sampling.expert_top_k is not None and budget is not None:
        validate_expert_top_k(sampling.expert_top_k, *budget)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    if len(ids) + sampling.max_tokens > max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens={sampling.max_tokens}, which exceeds "
                         f"the context limit of {max_model_len} tokens (prompt + completion); shorten the prompt or "
                         f"lower max_tokens")
