"""`moetailor bench ktiers`: per-request expert budgets under the four ``k_schedule``s
(routing/k_tiers.py: ``max``, ``mixed``, ``lanes``, ``tiers``), one heterogeneous workload each.

The k-aware schedules decide with a ``StepCost`` fitted to this machine's decode steps on a grid of
batch sizes x budgets (``measure_step_cost``): varying one at a time separates the per-step,
per-sequence, per-expert and per-route terms, which the workload's own steps cannot. Throughput is
completion tokens over wall time; time-to-first-token counts from submission (all queued at once).
"""
from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path

from .decode import load_bench_model
from .report import Report, close, figure

SCHEDULES = ("max", "mixed", "lanes", "tiers")


def parse_mix(text: str) -> list[tuple[int, float]]:
    """'2:0.5,8:0.5' -> [(2, 0.5), (8, 0.5)] (budget: share); shares are renormalised."""
    mix = []
    for part in text.split(","):
        try:
            k, share = part.split(":")
            mix.append((int(k), float(share)))
        except ValueError:
            raise ValueError(f"--mix part {part!r} is not K:SHARE; write e.g. --mix 2:0.5,8:0.5") from None
    if not mix or any(k < 1 or s <= 0 for k, s in mix):
        raise ValueError(f"--mix {text!r}: budgets must be >= 1 and shares > 0")
    return mix


def workload(mix: list[tuple[int, float]], n: int, prompt_len: int, vocab: int, seed: int = 0):
    """n (prompt ids, budget) pairs; budgets in random order, so arrival does not sort them."""
    rng = random.Random(seed)
    ks = rng.choices([k for k, _ in mix], [s for _, s in mix], k=n)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(prompt_len // 2, prompt_len + 1))]
               for _ in range(n)]
    return prompts, ks


def _params(ks: list[int], max_tokens: int) -> list:
    from ..serving import SamplingParams
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, expert_top_k=k) for k in ks]


def serve(llm, prompts, ks, max_tokens: int) -> dict:
    """Serve the whole workload at once; throughput, TTFT and what the decode steps touched."""
    llm.step_log.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(ks, max_tokens))
    wall = time.perf_counter() - start
    decode = [r for r in llm.step_log if r.phase == "decode"]
    ttft = sorted(o.metrics["ttft_s"] for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "decode_steps": len(decode),
            "distinct_experts": statistics.fmean(sum(r.distinct_experts.values()) / max(1, len(r.distinct_experts))
                                                 for r in decode) if decode else 0.0,
            "mean_step_k": statistics.fmean(r.mean_k for r in decode) if decode else 0.0}


def measure_step_cost(base, ks: list[int], max_num_seqs: int, prompts: list[list[int]], blocks: int):
    """Fit ``StepCost`` to decode steps of bursts of B requests sharing budget k, for B in
    {1, max/4, max/2, max} and every k in ``ks`` (5 decode steps per burst)."""
    from ..serving import LLM

    llm = LLM(base, max_num_seqs=max_num_seqs, num_kv_blocks=blocks)
    for b in sorted({min(b, len(prompts)) for b in (1, max(1, max_num_seqs // 4), max(1, max_num_seqs // 2),
                                                      max_num_seqs)}):
        for k in ks:
            llm.generate(prompts[:b], _params([k] * b, 6))
    return llm.fit_k_cost()


def run_ktiers(model: str, mix_text: str, requests: int, prompt_len: int, max_tokens: int, max_num_seqs: int,
               repeats: int, quick: bool, synthetic_layers: int, out: Path, command: str = "") -> Report:
    from tqdm import tqdm

    from ..serving import LLM

    if quick:
        requests, max_tokens, repeats = min(requests, 24), min(max_tokens, 12), 1
    mix = parse_mix(mix_text)
    base = load_bench_model(model, synthetic_layers)
    full_k = max(1, base.config.num_experts_per_tok)
    if max(k for k, _ in mix) > full_k:
        raise ValueError(f"--mix asks for k={max(k for k, _ in mix)} but the model routes {full_k} experts per token")
    vocab = base.get_output_embeddings().out_features
    prompts, ks = workload(mix, requests, prompt_len, vocab)
    blocks = max_num_seqs * ((prompt_len + max_tokens) // 16 + 2)
    # the cost grid also pays the first-call costs before anything is timed
    cost = measure_step_cost(base, sorted({k for k, _ in mix} | {full_k}), max_num_seqs, prompts, blocks)
    results: dict[str, list[dict]] = {s: [] for s in SCHEDULES}
    bar = tqdm(total=repeats * len(SCHEDULES), desc="bench ktiers", unit="run")
    for _ in range(repeats):
        for schedule in SCHEDULES:
            llm = LLM(base, max_num_seqs=max_num_seqs, num_kv_blocks=blocks, k_schedule=schedule, k_cost=cost)
            results[schedule].append(serve(llm, prompts, ks, max_tokens))
            bar.update()
            del llm
            gc.collect()
    bar.close()

    rep = Report("Per-request expert budgets: k-aware scheduling", out, command)
    best = {s: max(runs, key=lambda r: r["tokens_per_s"]) for s, runs in results.items()}
    base_tps = best["max"]["tokens_per_s"]
    rows = [(s, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base_tps:.2f}x", f"{r['ttft_mean_s']:.2f}",
             f"{r['ttft_p90_s']:.2f}", r["decode_steps"], f"{r['distinct_experts']:.1f}", f"{r['mean_step_k']:.2f}")
            for s, r in best.items()]
    mix_label = ", ".join(f"k={k}: {s:.0%}" for k, s in mix)
    rep.table(f"{model}: {requests} requests ({mix_label}), {max_tokens} tokens each, max {max_num_seqs} per step "
              f"(best of {repeats})",
              ["schedule", "tok/s", "vs max-k", "TTFT mean s", "TTFT p90 s", "decode steps", "experts/layer/step",
               "mean step k"], rows)
    rep.note(f"Step cost fitted to measured decode steps (batch x budget grid): fixed {cost.fixed * 1e3:.2f} ms, "
             f"per sequence {cost.per_token * 1e3:.3f} ms, per expert touched {cost.per_expert * 1e6:.1f} us, "
             f"per route {cost.per_route * 1e6:.2f} us (per MoE layer).")
    rep.data = {"model": model, "mix": mix, "requests": requests, "max_tokens": max_tokens,
                "max_num_seqs": max_num_seqs, "runs": results,
                "cost": {k: getattr(cost, k) for k in ("fixed", "per_token", "per_expert", "per_route")}}
    fig, ax = figure("schedule", "completion tokens/s", f"{model}: budgets {mix_label}")
    ax.bar(list(best), [r["tokens_per_s"] for r in best.values()])
    rep.plot(f"{Path(model).name}_ktiers.png", fig)
    close(fig)
    return rep
