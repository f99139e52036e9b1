"""Decode pools that follow the load, against always-full and always-pruned, over a mixed-load trace.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/pools_by_load.py --reference

Speed runs on the synthetic bandwidth-bound model (OLMoE-1B-7B layer shapes, seeded random weights,
built in memory; ``moetailor.bench.synthetic``). A closed-loop trace keeps a given number of
requests decoding, segment by segment (e.g. 1, 4, 16, 32, 8, 2 at once), so the decode batch
varies over time and requests move between pools mid-decode. Every policy serves the same
requests in the same order on one engine (one KV cache), repeated with the policy order rotated:

- ``full``: every decode step on the full pool; ``pruned N%``: every decode step on a masked pool
  keeping N% of each layer's experts (a seeded random subset, as ``bench decode`` uses);
- ``by load``: ``PoolsByLoad.from_slo`` over all those pools, with the step-cost model fitted to
  full-pool steps measured first in the same run (``LLM.fit_k_cost``) and the per-step SLO.

Per policy: decode tok/s, the share of decode tokens whose step met the SLO, the machine tok/s at
the SLO (``bench.slo.throughput_at_slo`` over the trace's median step per batch size), the share of
decode tokens on a reduced pool, and greedy agreement with the full pool (identical completions;
mean share of a completion before its first differing token). With ``--reference`` the same
policy shape (the same batch thresholds) runs on the bundled reference model with its bundled
REAP-50 decode plan over task prompts, and the answers are scored (accuracy).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch


def parse_trace(spec: str) -> list[tuple[int, int]]:
    """'1x24,16x24' -> [(1, 24), (16, 24)]: concurrency x decode steps per segment."""
    out = []
    for item in spec.split(","):
        n, _, steps = item.strip().partition("x")
        out.append((int(n), int(steps)))
    if not out or min(min(s) for s in out) < 1:
        raise ValueError(f"--trace {spec!r}: give CONCURRENCYxSTEPS,... with positive numbers")
    return out


def run_trace(llm, requests: list, segments: list[tuple[int, int]]) -> tuple[dict, list, float, dict]:
    """Serve ``requests`` [(prompt, SamplingParams)] in order, keeping each segment's number of
    requests running for its decode steps (segments repeat until every request has started), then
    drain. Returns the sequences by index, the step log, the wall seconds and, per request index,
    the batch sizes of the decode steps it took part in."""
    llm.step_log.clear()
    seqs, live, nxt, loads = {}, [], 0, {}
    index = {f"r{i}": i for i in range(len(requests))}

    def step() -> int:
        last = llm.step_log[-1] if llm.step_log else None
        stepped = llm.step()
        rec = llm.step_log[-1] if llm.step_log else None
        if rec is None or rec is last or rec.phase != "decode":
            return 0
        for seq in stepped:
            loads.setdefault(index[seq.request_id], []).append(rec.num_seqs)
        return 1

    start = time.perf_counter()
    while nxt < len(requests):
        for n, steps in segments:
            decode_steps = 0
            while decode_steps < steps and (nxt < len(requests) or live):
                live = [s for s in live if not s.is_finished]
                while len(live) < n and nxt < len(requests):
                    prompt, sp = requests[nxt]
                    seqs[nxt] = llm.add_request(prompt, sp, request_id=f"r{nxt}")
                    live.append(seqs[nxt])
                    nxt += 1
                decode_steps += step()
            if nxt >= len(requests):
                break
    while llm.has_unfinished():
        step()
    return seqs, list(llm.step_log), time.perf_counter() - start, loads


def load_class(batches: list[int], threshold: int) -> str:
    """'low' when every decode step of a request ran below the batch ``threshold``, 'high' when
    every one ran at or above it, else 'mixed'."""
    below = [b < threshold for b in batches]
    return "low" if all(below) else "high" if not any(below) else "mixed"


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of ``reference`` before the first token where ``tokens`` differs."""
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same / max(1, len(reference))


def summarize(log: list, wall: float, slo_s: float, full_m: int, always_reduced: bool = False) -> dict:
    """Decode speed, SLO attainment and tok/s at the SLO of one trace run (``step_log`` records)."""
    from moetailor.bench.slo import throughput_at_slo

    decode = [r for r in log if r.phase == "decode"]
    tokens = sum(r.num_seqs for r in decode)
    seconds = sum(r.seconds for r in decode)
    by_batch: dict[int, list[float]] = {}
    for r in decode:
        by_batch.setdefault(r.num_seqs, []).append(r.seconds)
    points = [(1 / statistics.median(s), b / statistics.median(s)) for b, s in sorted(by_batch.items())]
    at = throughput_at_slo(points, 1 / slo_s)
    return {"decode_tokens": tokens, "decode_s": seconds, "decode_tok_s": tokens / seconds, "wall_s": wall,
            "slo_token_share": sum(r.num_seqs for r in decode if r.seconds <= slo_s) / tokens,
            "tok_s_at_slo": at[1] if at else 0.0,
            "reduced_token_share": 1.0 if always_reduced else
            sum(r.num_seqs for r in decode if (r.pool_size or full_m) < full_m) / tokens,
            "median_step_ms": {b: round(1e3 * statistics.median(s), 1) for b, s in sorted(by_batch.items())}}


def synthetic_part(args) -> dict:
    from moetailor.bench.measure import make_llm, prompts
    from moetailor.bench.pools import mask_plan
    from moetailor.bench.synthetic import synthetic_model
    from moetailor.engine import SamplingParams
    from moetailor.engine.load_pools import PoolsByLoad, pool_size
    from moetailor.models.adapters import moe_layers

    shape = {"hidden": args.hidden, "expert_width": args.expert_width} if args.hidden else {}
    model = synthetic_model(layers=args.layers, experts=args.experts, **shape)
    layer = moe_layers(model)[0]
    m, k = layer.num_experts, layer.top_k
    segments = parse_trace(args.trace)
    max_batch = max(n for n, _ in segments)
    llm = make_llm(model, max_batch, args.prompt_len + args.max_tokens + 2)

    # the step-cost model: full-pool decode steps at several batch sizes, fitted (same run)
    for b in sorted({1, 2, 4, 8, 16, max_batch} & set(range(1, max_batch + 1))):
        llm.generate(prompts(b, args.prompt_len, llm.vocab_size, seed=1000 + b),
                     SamplingParams(max_tokens=6, ignore_eos=True))
    calib = [r for r in llm.step_log if r.phase == "decode"]
    cost = llm.fit_k_cost()
    full_ms = {b: 1e3 * statistics.median([r.seconds for r in calib if r.num_seqs == b])
               for b in sorted({r.num_seqs for r in calib})}
    slo_s = args.slo_ms / 1e3 if args.slo_ms else args.slo_factor * full_ms[min(8, max_batch)] / 1e3
    plans = {f"pruned {keep:.0%}": mask_plan(model, keep) for keep in args.keeps}
    pools = PoolsByLoad.from_slo([None, *plans.values()], cost, slo_s, k, max_batch)
    print(json.dumps({"fitted_cost": {f: getattr(cost, f) for f in ("per_expert", "per_route", "per_token", "fixed")},
                      "full_step_ms": {b: round(v, 1) for b, v in full_ms.items()}, "slo_ms": round(1e3 * slo_s, 1),
                      "by_load": pools.describe(),
                      "predicted_ms": {f"{pool_size(p, m)} experts": {
                          b: round(1e3 * dataclasses.replace(cost, num_experts=pool_size(p, m)).seconds(k, b), 1)
                          for b in (1, 8, max_batch)} for p in [None, *plans.values()]}}),
          flush=True)

    rng = random.Random(0)
    requests = [(prompts(1, args.prompt_len, llm.vocab_size, seed=i)[0],
                 SamplingParams(max_tokens=rng.randint(*args.max_tokens_range), ignore_eos=True))
                for i in range(args.requests)]
    policies = {"full": (None, None), **{name: (plan, None) for name, plan in plans.items()}, "by load": (None, pools)}
    runs: dict[str, list] = {name: [] for name in policies}
    names = list(policies)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:     # rotate the order
            plan, by_load = policies[name]
            llm.set_plan(plan)
            llm.set_decode_pools(by_load)
            seqs, log, wall, loads = run_trace(llm, requests, segments)
            runs[name].append(({i: s.completion_token_ids for i, s in seqs.items()}, log, wall, loads))
            print(json.dumps({"repeat": rep, "policy": name, "wall_s": round(wall, 1)}), flush=True)
    reference = runs["full"][0][0]
    threshold = min([r.min_batch for r in pools.rungs if r.pool_size < m] or [max_batch + 1])
    classes = {i: load_class(b, threshold) for i, b in runs["full"][0][3].items()}
    rows = {}
    for name, reps in runs.items():
        summaries = [summarize(log, wall, slo_s, m, name in plans) for _, log, wall, _ in reps]
        pooled = summarize([r for _, log, _, _ in reps for r in log], 0.0, slo_s, m, name in plans)
        outs = reps[0][0]
        by_class = {}
        for c in ("low", "mixed", "high"):
            ids = [i for i in reference if classes[i] == c]
            if ids:
                by_class[c] = {"requests": len(ids), "identical": sum(outs[i] == reference[i] for i in ids) / len(ids),
                               "agreement": statistics.fmean(agreement(outs[i], reference[i]) for i in ids)}
        rows[name] = {**{key: statistics.median(s[key] for s in summaries) for key in
                         ("decode_tok_s", "slo_token_share", "reduced_token_share", "wall_s")},
                      "tok_s_at_slo": pooled["tok_s_at_slo"],
                      "identical": sum(outs[i] == reference[i] for i in reference) / len(reference),
                      "agreement": statistics.fmean(agreement(outs[i], reference[i]) for i in reference),
                      "by_load": by_class, "repeats_identical": all(r[0] == reps[0][0] for r in reps),
                      "median_step_ms": pooled["median_step_ms"]}
        print(json.dumps({"policy": name, **rows[name]}), flush=True)
    return {"model": f"synthetic ({args.layers} MoE layer(s), {m} experts top-{k})", "slo_ms": 1e3 * slo_s,
            "threshold_batch": threshold,
            "by_load": pools.describe(), "thresholds": [(r.pool_size, r.min_batch) for r in pools.rungs],
            "trace": args.trace, "requests": args.requests, "repeats": args.repeats, "rows": rows}


def reference_part(args, thresholds: list[tuple[int, int]], m_synthetic: int) -> dict:
    """Accuracy of the same policy shape on the reference model: the full pool below the first
    reduced rung's batch threshold, the bundled REAP-50 decode plan from it on."""
    from moetailor.cli.demo import BUNDLED_PLAN
    from moetailor.data.tasks import TASKS, eval_examples, score
    from moetailor.engine import LLM, SamplingParams
    from moetailor.engine.load_pools import PoolRung, PoolsByLoad, pool_size
    from moetailor.plans import Plan

    reduced = [b for size, b in thresholds if size < m_synthetic]
    threshold = min(reduced) if reduced else 10**9
    segments = parse_trace(args.reference_trace)
    llm = LLM("reference", max_num_seqs=max(n for n, _ in segments))
    plan = Plan.load(BUNDLED_PLAN).phase_aware()
    m = llm.controller.layers[0].num_experts
    by_load = PoolsByLoad([PoolRung(None, m, 1), PoolRung(plan, pool_size(plan, m), threshold)])
    per_task = max(1, args.reference_requests // len(TASKS))
    examples = [ex for group in zip(*(eval_examples(t, per_task, seed=0) for t in TASKS.values())) for ex in group]
    sampling = SamplingParams(max_tokens=160, temperature=0.0)
    requests = [(ex.prompt, sampling) for ex in examples]
    rows, classes = {}, None
    for name, (p, pools) in {"full": (None, None), "pruned 50% (REAP)": (plan, None), "by load": (None, by_load)}.items():
        llm.set_plan(p)
        llm.set_decode_pools(pools)
        seqs, log, wall, loads = run_trace(llm, requests, segments)
        classes = classes or {i: load_class(loads.get(i, [1]), threshold) for i in range(len(examples))}
        decode = [r for r in log if r.phase == "decode"]
        tokens = sum(r.num_seqs for r in decode)
        reduced = tokens if p is not None else sum(r.num_seqs for r in decode if (r.pool_size or m) < m)
        correct = {i: score(ex, seqs[i].text) for i, ex in enumerate(examples)}
        by_class = {c: {"requests": sum(v == c for v in classes.values()),
                        "accuracy": statistics.fmean(correct[i] for i, v in classes.items() if v == c)}
                    for c in ("low", "mixed", "high") if c in classes.values()}
        rows[name] = {"accuracy": statistics.fmean(correct.values()), "reduced_token_share": reduced / tokens,
                      "by_load": by_class, "decode_tokens": tokens, "wall_s": wall}
        print(json.dumps({"reference policy": name, **rows[name]}), flush=True)
    return {"threshold_batch": threshold, "requests": len(examples), "trace": args.reference_trace, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="MoE layers of the synthetic model (1.6 GB of fp32 experts each)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=None, help="smaller shapes for a quick check (with --expert-width)")
    ap.add_argument("--expert-width", type=int, default=None)
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25], help="reduced pools (the by-load ladder)")
    ap.add_argument("--trace", default="1x24,4x24,16x24,32x24,8x24,2x24,24x24,1x24")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--max-tokens-range", type=int, nargs=2, default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--slo-ms", type=float, default=None,
                    help="per decode step (default: --slo-factor x the full pool's measured step at batch 8)")
    ap.add_argument("--slo-factor", type=float, default=1.15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reference", action="store_true", help="also score accuracy on the reference model")
    ap.add_argument("--reference-trace", default="1x300,4x200,32x100,8x200,2x300,16x100")
    ap.add_argument("--reference-requests", type=int, default=600)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.max_tokens = args.max_tokens_range[1]
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"threads": torch.get_num_threads(), "synthetic": synthetic_part(args)}
    if args.reference:
        syn = result["synthetic"]
        result["reference"] = reference_part(args, syn["thresholds"], args.experts)
    syn = result["synthetic"]
    print(f"\n{syn['model']}, trace {syn['trace']} ({syn['requests']} requests, {syn['repeats']} repeats), "
          f"SLO {syn['slo_ms']:.0f} ms per decode step; by load: {syn['by_load']}\n")
    low = syn["rows"]["full"]["by_load"].get("low", {}).get("requests", 0)
    print(f"low load: requests whose every decode step ran at batch < {syn['threshold_batch']} ({low} of "
          f"{syn['requests']})\n")
    print("| policy | decode tok/s | tokens within SLO | tok/s at SLO | tokens on a reduced pool | identical to full "
          "(all / low load) | agreement with full (all / low load) |\n|---|---|---|---|---|---|---|")
    for name, r in syn["rows"].items():
        lo = r["by_load"].get("low", {"identical": float("nan"), "agreement": float("nan")})
        print(f"| {name} | {r['decode_tok_s']:.0f} | {r['slo_token_share']:.0%} | {r['tok_s_at_slo']:.0f} | "
              f"{r['reduced_token_share']:.0%} | {r['identical']:.0%} / {lo['identical']:.0%} | "
              f"{r['agreement']:.0%} / {lo['agreement']:.0%} |")
    if "reference" in result:
        ref = result["reference"]
        classes = list(ref["rows"]["full"]["by_load"])
        counts = ", ".join(f"{c} {ref['rows']['full']['by_load'][c]['requests']}" for c in classes)
        print(f"\nreference model, {ref['requests']} task prompts ({counts}), trace {ref['trace']}, REAP-50 decode "
              f"pool from batch {ref['threshold_batch']}\n\n| policy | accuracy | "
              + " | ".join(f"{c} load" for c in classes) + " | tokens on the reduced pool |\n|---"
              + "|---" * (len(classes) + 2) + "|")
        for name, r in ref["rows"].items():
            print(f"| {name} | {r['accuracy']:.1%} | " + " | ".join(f"{r['by_load'][c]['accuracy']:.1%}" for c in classes)
                  + f" | {r['reduced_token_share']:.0%} |")
    if args.out:
        from moetailor.outputs import write_json
        write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
