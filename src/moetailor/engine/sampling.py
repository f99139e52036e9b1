"""Sampling parameters per request and the sampler that turns a step's logits into tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprobs import MAX_LOGPROBS


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None           # per-request torch.Generator: same seed, same tokens
    stop: tuple[str, ...] | list[str] = ()
    ignore_eos: bool = False
    expert_top_k: int | None = None   # per-request expert budget: active experts per token
    logprobs: int | None = None       # per generated token: its logprob and the top N (0 = its own only)
    prompt_logprobs: int | None = None  # the same per prompt token (computed in the prefill step)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field (the server turns it into a 400)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.expert_top_k is not None and self.expert_top_k < 1:
            raise ValueError(f"expert_top_k={self.expert_top_k} must be >= 1 (or None for the model's k)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} must be an integer from 0 to {MAX_LOGPROBS} (or None)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r} must be non-empty strings")


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [B, V]. Greedy rows take the argmax (ties: lowest id, like
    transformers); others: temperature, top-k, top-p, then a draw from the row's generator."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()                                # [B]
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            continue
        row = logits[i] / p.temperature                                    # [V]
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            outside = probs.cumsum(-1) - probs > p.top_p                   # keep the smallest set reaching top_p
            row = row.scatter(0, order[outside], float("-inf"))
        probs = row.softmax(-1)
        g = generators[i]
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=g).item()) if g is not None else \
            int(torch.multinomial(probs, 1).item())
    return tokens
