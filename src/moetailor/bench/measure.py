"""Timed decode and prefill through the engine (and through transformers ``generate``).

Each measurement runs ``batch`` seeded random prompts together, so every decode step holds the
whole batch; the engine's ``step_log`` gives each step's seconds, distinct experts per layer and
expert bytes. The first decode step is a warm-up and is not counted; the median step is reported.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..models.adapters import moe_layers


@dataclass
class DecodeResult:
    batch: int
    step_s: float                  # median decode step seconds
    distinct: float                # measured distinct experts per layer per step (mean)
    expert_bytes: float            # measured routed-expert bytes per step (mean)
    total_bytes: float             # expert bytes + other weights + KV read per step
    steps: int
    tokens: list[list[int]]        # generated ids per sequence (to compare pools that must agree)
    spread: float = 0.0            # (75th - 25th percentile step) / median step: how steady the figure is

    @property
    def noisy(self) -> bool:
        """Whether the median step is too unsteady to compare (``step_is_noisy``)."""
        return step_is_noisy(self.steps, self.spread)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def bandwidth(self) -> float:
        return self.total_bytes / self.step_s


MIN_STEADY_STEPS = 8      # fewer timed steps than this: the median is one or two steps' luck
MAX_STEADY_SPREAD = 0.25  # an interquartile range above a quarter of the median: the machine was busy


def step_is_noisy(steps: int, spread: float) -> bool:
    """Whether a median over ``steps`` timed steps with interquartile ``spread`` (relative to the median)
    is too unsteady to print unflagged: on a shared 2-core machine a sub-millisecond step timed over 4
    steps gave a half pool at 0.62x the full pool's speed."""
    return steps < MIN_STEADY_STEPS or spread > MAX_STEADY_SPREAD


def relative_spread(times: list[float]) -> float:
    """(75th - 25th percentile) / median of step times; 0 for fewer than 2."""
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4, method="inclusive")
    return (q[2] - q[0]) / statistics.median(times)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def static_bytes(model) -> int:
    """Weight bytes a decode step reads besides routed experts: all parameters except the routed
    experts and the input embedding (a lookup reads only the batch's rows)."""
    experts = {id(l.experts.gate_up_proj) for l in moe_layers(model)} | {id(l.experts.down_proj) for l in moe_layers(model)}
    embed = id(model.get_input_embeddings().weight)
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts and id(p) != embed)


def make_llm(model, max_batch: int, max_len: int, compile_decode: bool = False, pack_weights: bool | None = None):
    """An engine for a benchmark on ``model``. ``pack_weights``: as ``LLM``'s; a bench that hands its
    model over (nothing needs its own layout afterwards: transformers' generate and pruning ran
    before) passes ``kernels.packed_weights_pay()``, so it measures what ``moetailor serve`` runs."""
    from ..serving import LLM

    blocks_per_seq = (max_len + 15) // 16 + 1
    return LLM(model, max_num_seqs=max_batch, max_num_batched_tokens=max(4096, max_batch * max_len),
               num_kv_blocks=max_batch * blocks_per_seq + 4, max_model_len=max_len + 16, compile_decode=compile_decode,
               pack_weights=pack_weights)


def engine_decode(llm, batch: int, prompt_len: int, steps: int, expert_top_k: int | None = None,
                  seed: int = 0, prompt_ids: list[list[int]] | None = None) -> DecodeResult:
    """Decode ``steps`` tokens (after one warm-up step) for ``batch`` sequences through ``llm``
    (``prompt_ids``: ``batch`` prompts of ``prompt_len`` tokens instead of seeded random ids)."""
    from ..serving import SamplingParams

    if prompt_ids is None:
        prompt_ids = prompts(batch, prompt_len, llm.vocab_size, seed)
    elif len(prompt_ids) != batch or any(len(p) != prompt_len for p in prompt_ids):
        raise ValueError(f"prompt_ids must hold {batch} prompts of {prompt_len} tokens")
    llm.step_log.clear()
    sp = SamplingParams(max_tokens=steps + 2, ignore_eos=True, expert_top_k=expert_top_k)
    outs = llm.generate(prompt_ids, sp)
    records = [r for r in llm.step_log if r.phase == "decode" and r.num_seqs == batch][1:]
    if not records:
        raise RuntimeError(f"no full-batch decode steps were logged for batch {batch}")
    times = [r.seconds for r in records]
    step_s = statistics.median(times)
    distinct = statistics.fmean(statistics.fmean(r.distinct_experts.values()) for r in records)
    expert_b = statistics.fmean(r.expert_bytes for r in records)
    kv_per_token = llm.runner.block_bytes / llm.config.block_size
    mean_ctx = prompt_len + 1 + steps / 2
    total = expert_b + static_bytes(llm.model) + batch * mean_ctx * kv_per_token
    return DecodeResult(batch, step_s, distinct, expert_b, total, len(records), [o.token_ids for o in outs],
                        relative_spread(times))


class _StepClock:
    """A transformers streamer that timestamps each generated token (``put`` runs once per step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, batch: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """Median decode step seconds of transformers ``generate`` (greedy, KV cache) on the same prompts.
    ``model`` should be stock (no RoutingController), so this is what transformers alone delivers."""
    vocab = model.get_output_embeddings().out_features
    ids = torch.tensor(prompts(batch, prompt_len, vocab, seed))                 # [B, L]
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2,
                       min_new_tokens=steps + 2, do_sample=False, streamer=clock,
                       pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    # times[0]: prompt pushed; times[1]: first token (prefill); then one per decode step
    gaps = [b - a for a, b in zip(clock.times[2:], clock.times[3:])]
    return statistics.median(gaps)


def engine_prefill(llm, batch: int, prompt_len: int, repeats: int = 3, seed: int = 0) -> float:
    """Best prefill tokens/s of ``batch`` prompts of ``prompt_len`` tokens admitted in one step."""
    from ..serving import SamplingParams

    best = 0.0
    for r in range(repeats):
        llm.step_log.clear()
        llm.generate(prompts(batch, prompt_len, llm.vocab_size, seed + r), SamplingParams(max_tokens=1, ignore_eos=True))
        best = max([best] + [rec.num_tokens / rec.seconds for rec in llm.step_log if rec.phase == "prefill"])
    return best


def best_us(fn, calls: int = 100, rounds: int = 5, warmup: int = 5) -> float:
    """Microseconds per call of ``fn``: the best of ``rounds`` rounds of ``calls`` calls, after ``warmup``
    calls (the least disturbed round on a shared machine)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best
