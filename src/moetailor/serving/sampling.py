"""Sampling parameters per request and the sampler that turns a step's logits into tokens."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .logprobs import MAX_LOGPROBS

MIN_TEMPERATURE = 1e-3   # below it logits / temperature can overflow to inf (use 0 for greedy)
MAX_SEED = 2**63 - 1     # a torch.Generator seed


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
        """Raise ValueError naming the bad field (the server turns it into a 400). Floats must be finite:
        a NaN passes every ``<`` check and a subnormal temperature overflows the logits to inf.
        ``expert_top_k`` is checked against the model when the request is added
        (``budgets.validate_expert_top_k``, the one owner of the budget rules)."""
        def integer(name, low, high=None, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or \
                    (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name}={value!r} must be an integer {bound}")

        def real(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
            return float(value)

        integer("max_tokens", 1)
        temperature = real("temperature")
        if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature!r} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        if not 0.0 < real("top_p") <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        integer("top_k", 0)
        integer("seed", 0, MAX_SEED, optional=True)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be true or false")
        integer("logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r} must be non-empty strings")


class NonFiniteLogits(ValueError):
    """A row of logits with NaN or infinite values: the request it belongs to cannot go on."""


def per_prompt(prompts, sampling) -> tuple[list, list[SamplingParams]]:
    """``generate``'s arguments as one prompt list and one ``SamplingParams`` per prompt: a single prompt
    (a string or token ids) becomes a list of one; ``sampling`` is one for all (None: the defaults) or a
    list with one per prompt."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
    return prompts, params


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [B, V]. Greedy rows take the argmax (ties: lowest id, like
    transformers); others: temperature, top-k, top-p, then a draw from the row's generator."""
    logits = logits.float()
    if logits.device.type == "cpu" and not logits.requires_grad:
        # numpy on CPU: the same first-maximum rule (NaN counts as the maximum in both), several times
        # cheaper than torch's ops on a batch-1 step's vocabulary row (a decode step's fixed cost)
        rows = logits.numpy()                                              # [B, V] (shares memory)
        argmax = rows.argmax(-1)                                           # [B]
        finite = bool(np.isfinite(rows[np.arange(len(argmax)), argmax]).all())
    else:
        argmax = logits.argmax(dim=-1)                                     # [B]
        finite = bool(torch.isfinite(logits.gather(1, argmax[:, None])).all())
    tokens = argmax.tolist()
    if not finite:   # a row with NaN (the argmax) or +inf, or all -inf
        raise NonFiniteLogits("the model produced NaN or infinite logits for this request, so no token can be "
                              "sampled; a weight of the checkpoint is NaN or infinite, or the forward overflowed "
                              "(check the checkpoint, or run it in a wider dtype)")
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
