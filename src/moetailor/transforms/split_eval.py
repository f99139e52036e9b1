"""Measuring a split model: quality per budget, and the k-aware batching benchmark.

Quality (``budget_quality``): teacher-forced next-token KL(original || candidate) on held-out
windows (``data.corpus.bundled_documents('heldout')``), for the split model at each budget of
sub-experts per token and, at equal active parameters, for the original model with whole-expert
top-k reduction (budget / N experts, where that is a whole number).

Throughput (``bench_k_tiers``): one run, two schedules of the same heterogeneous request mix on the
engine ``LLM``: the baseline serves arrival-order batches at each batch's largest k; the k-aware
schedule serves ``engine.k_tiers.plan_offline`` batches. The engine's own scheduler is left as
it is: each planned batch is one ``LLM.generate`` call with every member's ``expert_top_k`` set
to the batch's k, and batches run back to back, so a request's time to first token is its
batch's start plus the engine's own TTFT. The step cost model is fitted on measured warm-up steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BudgetScore:
    model: str     # "split" | "original"
    budget: int    # sub-experts per token (original: experts x N)
    kl: float      # mean next-token KL(original || this), nats
    tokens: int


@torch.no_grad()
def _logprobs(model, ids: torch.Tensor, k: int | None) -> torch.Tensor:
    from ..routing import RoutingController

    ctl = RoutingController.of(model)
    token_k = None if k is None else torch.full((ids.numel(),), k, dtype=torch.long)
    with ctl.policy(None, token_top_k=token_k):
        return F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)   # [B, S, V]


def heldout_batches(tokenizer, docs_per_domain: int = 2, window: int = 128, batch: int = 8) -> list[torch.Tensor]:
    from ..data.corpus import bundled_documents
    from ..eval.metrics import heldout_windows

    windows = heldout_windows(tokenizer, bundled_documents("heldout"), docs_per_domain, window)
    return [torch.tensor(windows[i:i + batch]) for i in range(0, len(windows), batch)]


def budget_quality(original, split, parts: int, batches: list[torch.Tensor], budgets: list[int],
                   progress: bool = True) -> list[BudgetScore]:
    """KL of the split model at each budget and of the original at budget / N whole experts."""
    from tqdm import tqdm

    reference = [_logprobs(original, ids, None) for ids in batches]
    k_orig = int(original.config.num_experts_per_tok)
    jobs = [("split", b) for b in budgets] + [("original", b) for b in budgets
                                              if b % parts == 0 and 1 <= b // parts <= k_orig]
    out = []
    for kind, b in tqdm(jobs, desc="budgets", disable=not progress):
        kl, n = 0.0, 0
        for ids, ref in zip(batches, reference):
            logp = _logprobs(split, ids, b) if kind == "split" else _logprobs(original, ids, b // parts)
            kl += float((ref.exp() * (ref - logp)).sum(-1).sum())
            n += ids.numel()
        out.append(BudgetScore(kind, b, max(kl / n, 0.0), n))
    return out


# ---------------------------------------------------------------------------------------------
# throughput: k-aware schedule vs max-k batches
# ---------------------------------------------------------------------------------------------

@dataclass
class ScheduleResult:
    name: str
    seconds: float
    tokens: int
    ttft_p50: float
    ttft_p90: float
    batches: int
    upgraded: int       # requests served above their budget
    mean_k: float       # mean k a generated token ran at

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def run_schedule(llm, name: str, batches, prompts: dict[str, list[int]], max_tokens: int) -> ScheduleResult:
    from ..engine import SamplingParams
    from ..eval.metrics import percentile

    ttft, tokens, k_tokens = [], 0, 0
    start = time.perf_counter()
    for b in batches:
        offset = time.perf_counter() - start
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, expert_top_k=b.k)
        outs = llm.generate([prompts[i] for i in b.request_ids], sp)
        for o in outs:
            ttft.append(offset + o.metrics.get("ttft_s", 0.0))
            tokens += len(o.token_ids)
            k_tokens += b.k * len(o.token_ids)
    seconds = time.perf_counter() - start
    return ScheduleResult(name, seconds, tokens, percentile(ttft, 50), percentile(ttft, 90), len(batches),
                          sum(len(b.upgraded) for b in batches), k_tokens / max(tokens, 1))


def fit_step_cost(llm, prompt: list[int], ks: list[int], sizes: list[int], steps: int = 4):
    """Measure decode steps at a few (batch, k) points and fit ``StepCost`` to them."""
    from ..engine import SamplingParams
    from ..engine.k_tiers import StepCost

    samples = []
    layers = llm.controller.layers
    for B in sizes:
        for k in ks:
            llm.step_log.clear()
            llm.generate([prompt] * B, SamplingParams(max_tokens=steps + 1, ignore_eos=True, expert_top_k=k))
            for r in llm.step_log:
                if r.phase == "decode" and r.num_seqs == B:
                    u = sum(r.distinct_experts.values()) / max(1, len(r.distinct_experts))
                    samples.append((B, k, u, r.seconds))
    return StepCost.fit(samples, len(layers), layers[0].num_experts), samples


def bench_k_tiers(llm, requests, prompts: dict[str, list[int]], max_batch: int, max_tokens: int, cost,
                  repeats: int = 2) -> list[ScheduleResult]:
    """Baseline (arrival batches at max k) and k-aware (``plan_offline``) on the same requests,
    alternated ``repeats`` times; returns every run (the caller reports medians)."""
    from ..engine.k_tiers import plan_fcfs_max_k, plan_offline

    plans = {"max-k batches": plan_fcfs_max_k(requests, max_batch), "k-aware tiers": plan_offline(requests, max_batch, cost)}
    out = []
    for _ in range(repeats):
        for name, batches in plans.items():
            out.append(run_schedule(llm, name, batches, prompts, max_tokens))
    return out
