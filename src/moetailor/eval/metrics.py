"""What an expert budget does to a model: accuracy, how long it talks, and how far it drifts.

Accuracy alone hides the damage (a pruned prefill stops too early, a pruned decode runs to the length
budget), so every configuration is scored on exact-match accuracy, output length p50 / p90, the
shares hitting ``max_tokens`` and ending on EOS, and held-out KL and perplexity. Held-out text is
scored as the engine serves it: the first half of each window under the *prefill* policy (writing the
KV cache), the second half, where KL is measured, from that cache under the *decode* policy; so
Reverse and Phase-aware get different numbers and the full model scores KL 0.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..data.tasks import Example, score
from ..routing import RoutingController
from ..routing.policy import PhasePolicy

# ---- generation metrics --------------------------------------------------------------------------

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


# ---- a quality floor against the full model: paired ratio of accuracies, its interval, the verdict ----

MEETS, MISSES, UNDECIDED = "meets", "misses", "not enough prompts to tell"
Z95 = 1.959963984540054      # two-sided 95%: each bound is a one-sided 2.5% test


@dataclass(frozen=True)
class PairedCounts:
    """One candidate against the full model on the same prompts: both right, only the candidate right
    (gained), only the full model right (lost), neither."""

    both: int
    gained: int
    lost: int
    neither: int

    @classmethod
    def of(cls, candidate: Sequence[bool], full: Sequence[bool]) -> "PairedCounts":
        if len(candidate) != len(full):
            raise ValueError(f"paired counts need the same prompts: {len(candidate)} vs {len(full)} results")
        pairs = list(zip(map(bool, candidate), map(bool, full)))
        return cls(pairs.count((True, True)), pairs.count((True, False)), pairs.count((False, True)),
                   pairs.count((False, False)))

    @property
    def n(self) -> int:
        return self.both + self.gained + self.lost + self.neither


def ratio_score(c: PairedCounts, r: float) -> float:
    """Score statistic for H0: candidate accuracy = r x full accuracy on paired prompts (Nam & Blackwelder
    2002; Tang, Tang & Chan 2003): the observed sum of (candidate right - r x full right) over its standard
    deviation under the constrained maximum-likelihood cell probabilities (closed form). Positive when
    the candidate keeps more than r of the full model; decreasing in r."""
    n, a, b, l = c.n, c.both, c.gained, c.lost
    num = a + b - r * (a + l)
    qa, qb = n * (1 + r), (a + l) * r * r - (a + b + 2 * l)
    qc = l * (1 - r) * (a + b + l) / n
    lost = (-qb + math.sqrt(max(qb * qb - 4 * qa * qc, 0.0))) / (2 * qa)    # constrained P(only full right)
    var = n * (1 + r) * lost + (a + b + l) * (r - 1)                         # n x per-prompt variance
    if var <= 1e-12 * max(n, 1):
        return 0.0 if abs(num) < 1e-12 else math.copysign(math.inf, num)
    return num / math.sqrt(var)


def ratio_interval(c: PairedCounts, z: float = Z95) -> tuple[float, float]:
    """The score interval for candidate accuracy / full accuracy: every r the score test at ``z`` does
    not reject (found by bisection; the statistic decreases in r). Unlike a bootstrap over prompts it
    keeps its coverage when no prompt was lost or gained (a bootstrap then collapses onto the estimate)."""
    full = c.both + c.lost
    est = (c.both + c.gained) / full

    def root(lo: float, hi: float, target: float) -> float:
        for _ in range(100):
            mid = (lo + hi) / 2
            if ratio_score(c, mid) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if est == 0 or ratio_score(c, 1e-12) <= z else root(1e-12, est, z)
    hi = max(est, 1.0) * 2 + 1
    while ratio_score(c, hi) > -z and hi < 1e9:
        hi *= 2
    return low, root(est, hi, -z)


@dataclass(frozen=True)
class FloorVerdict:
    """Whether a candidate keeps ``floor`` of the full model's accuracy, as far as these prompts tell."""

    ratio: float                 # candidate accuracy / full accuracy
    low: float                   # 95% score interval of the ratio (paired over prompts)
    high: float
    floor: float
    verdict: str                 # MEETS (low >= floor) | MISSES (high < floor) | UNDECIDED
    prompts: int
    gained: int
    lost: int
    prompts_to_decide: int | None   # undecided: prompts at which the observed rates would decide (None: never)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "FloorVerdict":
        return cls(**d)

    def interval(self) -> str:
        """'98.6% of full (95% CI 95.5-101.4%)'."""
        if math.isnan(self.ratio):
            return "share of full undefined (the full model answers none)"
        return f"{100 * self.ratio:.1f}% of full (95% CI {100 * self.low:.1f}-{100 * self.high:.1f}%)"

    def decide(self, per_task: int | None = None) -> str:
        """What would settle an undecided verdict, '' otherwise (``per_task``: tasks, for a --n)."""
        if self.verdict != UNDECIDED or math.isnan(self.ratio):
            return ""
        if self.prompts_to_decide is None:
            return "the estimate sits on the floor: no number of prompts decides it"
        way = MEETS if self.ratio > self.floor else MISSES
        more = f"; --n {-(-self.prompts_to_decide // per_task)}" if per_task else ""
        return f"at these rates about {self.prompts_to_decide} prompts would decide ({way}{more})"

    def describe(self, per_task: int | None = None) -> str:
        """'101.9% of full (95% CI 95.0-110.8%), +1/-0 of 60 prompts: not enough prompts to tell; at these
        rates about 88 prompts would decide (meets; --n 15)'. The projection assumes the observed gain and
        loss rates, which a handful of changed prompts pins down poorly: rerun there and read the verdict."""
        out = f"{self.interval()}, +{self.gained}/-{self.lost} of {self.prompts} prompts: {self.verdict}"
        more = self.decide(per_task)
        return out + (f"; {more}" if more else "")


def floor_verdict(counts: PairedCounts, floor: float, z: float = Z95) -> FloorVerdict:
    """A quality floor against the full model, decided only when the prompts can tell: MEETS when the
    interval's lower bound is at or above ``floor``, MISSES when its upper bound is below it, UNDECIDED
    when it straddles the floor, with the number of prompts at which the observed per-prompt rates would
    decide (the score statistic at the floor grows with the square root of the prompts)."""
    c = counts
    if c.both + c.lost == 0:      # the full model answers none: no share of its accuracy exists
        return FloorVerdict(float("nan"), float("nan"), float("nan"), floor, UNDECIDED, c.n, c.gained, c.lost, None)
    ratio = (c.both + c.gained) / (c.both + c.lost)
    low, high = ratio_interval(c, z)
    verdict = MEETS if low >= floor - 1e-9 else MISSES if high < floor - 1e-9 else UNDECIDED
    need = None
    if verdict == UNDECIDED:
        t = ratio_score(c, floor)
        need = math.ceil(c.n * (z / t) ** 2) + 1 if abs(t) > 1e-9 else None
    return FloorVerdict(ratio, low, high, floor, verdict, c.n, c.gained, c.lost, need)


def sign_test(gained: int, lost: int) -> float:
    """Two-sided exact sign (McNemar) test on the discordant pairs of two paired runs: the chance of a
    split at least this uneven if either side were as likely to win each prompt."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def versus_full(candidate: Sequence[bool], full: Sequence[bool], prompts: Sequence, floor: float | None) -> dict:
    """A configuration against the full model on the same prompts, pooled over prompt sets: its share of
    the full model's accuracy with the paired 95% interval, the changed prompts and their sign test, and
    with a ``floor`` the verdict. ``prompts`` names each result's prompt: one that comes again (the task
    generators repeat a few prompts across seeds) counts once, as its first result."""
    seen, mine, theirs = set(), [], []
    for key, c, f in zip(prompts, candidate, full, strict=True):
        if key not in seen:
            seen.add(key)
            mine.append(c)
            theirs.append(f)
    v = floor_verdict(PairedCounts.of(mine, theirs), 1.0 if floor is None else floor)
    undefined = math.isnan(v.ratio)      # the full model answers none: no share of its accuracy (None in JSON)
    out = {"ratio": None if undefined else v.ratio, "low": None if undefined else v.low,
           "high": None if undefined else v.high, "prompts": v.prompts, "gained": v.gained, "lost": v.lost,
           "sign_p": sign_test(v.gained, v.lost)}
    if floor is not None:
        out.update(floor=floor, verdict=v.verdict, prompts_to_decide=v.prompts_to_decide)
    return out


# ---- held-out text: KL from the full model and perplexity ----------------------------------------

def kl_divergence(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || q) per position from log-probabilities [..., V] -> [...] (nats)."""
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def heldout_windows(tokenizer, documents: dict[str, list[str]], docs_per_domain: int, window: int) -> list[list[int]]:
    """The first ``window`` tokens of the first ``docs_per_domain`` documents of each domain
    (documents shorter than a window are skipped)."""
    out = []
    for docs in documents.values():
        long_enough = (ids for ids in (tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs)
                       if len(ids) >= window)
        out += [ids[:window] for ids in itertools.islice(long_enough, docs_per_domain)]
    if not out:
        raise ValueError(f"no held-out document has {window} tokens; use a shorter --kl-window")
    return out


def _cache_argument(model) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier releases, e.g. the one vLLM's CPU build pins in ``.venv-vllm``,
    whose forward would swallow ``cache=`` unread and run the continuation without its prefix)."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


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
        rest = model(input_ids=ids[:, split:], use_cache=True, **{_cache_argument(model): cache})
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
