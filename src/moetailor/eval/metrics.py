"""What an expert budget does to a model: accuracy, how long it talks, and how far it drifts.

SlimWise's point is that accuracy alone hides the damage: a pruned prefill stops too early, a
pruned decode runs on until the length budget. So every configuration is scored on

* exact-match accuracy (the task suite's scorer),
* output length p50 / p90 in tokens, the share of generations that hit ``max_tokens`` and the
  share that ended with EOS,
* teacher-forced next-token KL divergence from the full model, and perplexity, on held-out text.

Held-out text is scored the way the engine serves it: each window is split in half, the first
half runs under the configuration's *prefill* policy (writing the KV cache) and the second half
continues from that cache under its *decode* policy; KL and perplexity are measured on the second
half. So Reverse (pruned prefill) and Phase-aware (pruned decode) get different numbers, and the
full model scores KL 0.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..routing import RoutingController
from ..routing.policy import PhasePolicy
from ..data.tasks import Example, score


# ---------------------------------------------------------------------------------------------
# generation metrics
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """One evaluated generation, reduced to what the metrics need (stored per sweep cell)."""

    task: str
    difficulty: int
    correct: bool
    length: int          # generated tokens
    finish_reason: str   # "stop" (EOS) | "length" (hit max_tokens) | "abort" | "error"
    max_tokens: int

    def to_json(self) -> list:
        return [self.task, self.difficulty, int(self.correct), self.length, self.finish_reason, self.max_tokens]

    @classmethod
    def from_json(cls, row: list) -> "Generation":
        task, difficulty, correct, length, finish, max_tokens = row
        return cls(task, int(difficulty), bool(correct), int(length), finish, int(max_tokens))


def score_output(example: Example, output, max_tokens: int) -> Generation:
    """A RequestOutput (text, token_ids, finish_reason) scored against its example."""
    return Generation(example.task, example.difficulty, score(example, output.text), len(output.token_ids),
                      output.finish_reason, max_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class LengthStats:
    n: int
    p50: float
    p90: float
    mean: float
    budget_hit: float  # share of generations that stopped because they reached max_tokens
    eos: float         # share that ended with the end-of-sequence token

    def to_json(self) -> dict:
        return asdict(self)


def length_stats(gens: Sequence[Generation]) -> LengthStats:
    """Length distribution of a set of generations. A generation hits the budget when the engine
    stopped it for length (or it produced max_tokens tokens without another reason)."""
    if not gens:
        return LengthStats(0, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"))
    lengths = [g.length for g in gens]
    hit = [g.finish_reason == "length" or (g.finish_reason != "stop" and g.length >= g.max_tokens) for g in gens]
    eos = [g.finish_reason == "stop" for g in gens]
    return LengthStats(len(gens), percentile(lengths, 50), percentile(lengths, 90), float(np.mean(lengths)),
                       float(np.mean(hit)), float(np.mean(eos)))


def accuracy(gens: Sequence[Generation]) -> float:
    return float(np.mean([g.correct for g in gens])) if gens else float("nan")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1) over seeds; std is 0 for a single seed."""
    if len(values) == 0:
        return float("nan"), float("nan")
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


# ---------------------------------------------------------------------------------------------
# held-out text: KL from the full model and perplexity
# ---------------------------------------------------------------------------------------------

def kl_divergence(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || q) per position from log-probabilities [..., V] -> [...] (nats)."""
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def heldout_windows(tokenizer, documents: dict[str, list[str]], docs_per_domain: int, window: int) -> list[list[int]]:
    """The first ``window`` tokens of the first ``docs_per_domain`` documents of each domain
    (documents shorter than a window are skipped)."""
    out = []
    for docs in documents.values():
        taken = 0
        for doc in docs:
            if taken >= docs_per_domain:
                break
            ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
            if len(ids) >= window:
                out.append(ids[:window])
                taken += 1
    if not out:
        raise ValueError(f"no held-out document has {window} tokens; use a shorter --kl-window")
    return out


@torch.no_grad()
def _split_forward(model, ctl: RoutingController, ids: torch.Tensor, split: int,
                   prefill: PhasePolicy | None, decode: PhasePolicy | None, decode_model=None) -> torch.Tensor:
    """Log-probs [B, T - split, V] predicting tokens split+1.. : the prefix [0, split) runs under
    ``prefill`` and writes the KV cache, the rest runs under ``decode`` from that cache (on
    ``decode_model`` when given: a distilled decoder continuing the original model's cache)."""
    with ctl.policy(prefill):
        first = model(input_ids=ids[:, :split], use_cache=True)
    cache = getattr(first, "cache", None)
    if cache is None:
        cache = first.past_key_values
    if decode_model is not None:
        model, ctl = decode_model, RoutingController.of(decode_model)
    with ctl.policy(decode):
        rest = model(input_ids=ids[:, split:], cache=cache, use_cache=True)
    logits = rest.logits[:, :-1].float()                                     # [B, T-split-1, V]
    logits = torch.cat([first.logits[:, -1:].float(), logits], dim=1)        # [B, T-split, V]
    return F.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class HeldoutScore:
    kl: float          # mean next-token KL(full || configuration), nats per token
    perplexity: float  # exp(mean NLL) of the configuration on the held-out continuation
    tokens: int

    def to_json(self) -> dict:
        return asdict(self)


class HeldoutScorer:
    """Scores configurations on fixed held-out windows against the full model's predictions,
    which are computed once and reused (the full model is the reference for every KL)."""

    def __init__(self, model, windows: list[list[int]], batch_size: int = 8):
        self.model = model
        self.ctl = RoutingController.of(model)
        self.device = next(model.parameters()).device
        self.windows = windows
        self.split = len(windows[0]) // 2
        self.batch_size = batch_size
        self._reference: list[torch.Tensor] | None = None

    def _batches(self):
        for i in range(0, len(self.windows), self.batch_size):
            yield torch.tensor(self.windows[i:i + self.batch_size], device=self.device)  # [B, T]

    def reference(self) -> list[torch.Tensor]:
        if self._reference is None:
            self._reference = [_split_forward(self.model, self.ctl, ids, self.split, None, None)
                               for ids in self._batches()]
        return self._reference

    def score(self, prefill: PhasePolicy | None, decode: PhasePolicy | None, decode_model=None) -> HeldoutScore:
        kl_sum, nll_sum, n = 0.0, 0.0, 0
        for ids, logp_ref in zip(self._batches(), self.reference()):
            logp = _split_forward(self.model, self.ctl, ids, self.split, prefill, decode, decode_model)  # [B, S, V]
            target = ids[:, self.split:]                                                  # [B, S]
            kl_sum += float(kl_divergence(logp_ref, logp).sum())
            nll_sum += float(-logp.gather(-1, target[..., None]).sum())
            n += target.numel()
        return HeldoutScore(kl=max(kl_sum / n, 0.0), perplexity=math.exp(nll_sum / n), tokens=n)
