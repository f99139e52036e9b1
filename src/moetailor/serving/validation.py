"""Request checks shared by the colocated engine and the disaggregated front end, so both answer
a bad request with the same ValueError before any engine or worker sees it."""
from __future__ import annotations

from dataclasses import dataclass

from ..routing.budgets import validate_expert_top_k
from .sampling import SamplingParams

NO_TOKENIZER = ("a text prompt needs a tokenizer and this model folder has no tokenizer files (tokenizer.json / "
                "tokenizer_config.json); copy them into the folder, pass tokenizer=, or send token ids")


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can run (a disaggregated front end: the tighter of its two workers)."""
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    budget: tuple[int, int | None]    # (max expert_top_k, sub-expert parts or None)

    def tighter(self, other: "RequestLimits") -> "RequestLimits":
        return RequestLimits(min(self.vocab_size, other.vocab_size), min(self.max_model_len, other.max_model_len),
                             min(self.max_num_batched_tokens, other.max_num_batched_tokens),
                             min(self.num_blocks, other.num_blocks), self.block_size,
                             min(self.budget, other.budget, key=lambda b: b[0]))


def encode_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a text or token-id prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))
    if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
        raise ValueError("a token-id prompt must be a list of integers")
    return None, list(prompt)


def check_request(ids: list[int], sampling: SamplingParams, limits: RequestLimits) -> None:
    """ValueError naming the problem and the limit when a request can never run."""
    sampling.validate()
    validate_expert_top_k(sampling.expert_top_k, *limits.budget)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{limits.vocab_size - 1})")
    if len(ids) + sampling.max_tokens > limits.max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens={sampling.max_tokens}, which exceeds "
                         f"the context limit of {limits.max_model_len} tokens (prompt + completion); shorten the "
                         f"prompt or lower max_tokens")
    if len(ids) > limits.max_num_batched_tokens:
        raise ValueError(f"the prompt has {len(ids)} tokens, more than max_num_batched_tokens="
                         f"{limits.max_num_batched_tokens}; raise max_num_batched_tokens")
    bs = limits.block_size
    need = (len(ids) + sampling.max_tokens + bs - 1) // bs
    if need > limits.num_blocks:
        raise ValueError(f"the request needs {need} KV blocks of {bs} tokens but the pool holds "
                         f"{limits.num_blocks}; lower max_tokens or give more num_kv_blocks")


def completion_room(n_prompt: int, limits: RequestLimits) -> tuple[int, str]:
    """(tokens a completion may have after an ``n_prompt``-token prompt, what bounds it): the context
    limit or, where it holds fewer tokens, the KV pool. A chat request without max_tokens gets all of
    it, as in the OpenAI API and vLLM."""
    pool = limits.num_blocks * limits.block_size
    if pool < limits.max_model_len:
        return pool - n_prompt, f"the KV pool's {pool} tokens ({limits.num_blocks} blocks of {limits.block_size})"
    return limits.max_model_len - n_prompt, f"the context limit of {limits.max_model_len} tokens"
