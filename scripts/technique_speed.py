"""Folding cost and skipping speed on the synthetic bandwidth-bound model (issues 7 and 8), one run.

    nice -n 5 .venv/bin/python scripts/technique_speed.py --out build/bench/techniques

1. Decode step cost at the same budget (D of m experts): plain masking (static pool, re-routed),
   static pool with dropped routes, static pool with folding (plan+fold), the batch pool of D
   experts with dropped routes and with folding (fold-decode:D). All pools run in the same
   process, interleaved over ``--repeats`` rounds (shared-machine noise hits all alike); the
   median decode step of each pool is reported with the ratios fold/mask and fold/drop.
2. Prefill TTFT at batch 1 with K_pre < k (fold-prefill:K_pre, drop-prefill:K_pre) vs full.

Fold tables come from a routed-mode calibration of the synthetic model on random token ids
(``--calib-tokens``); what is timed does not depend on their values beyond which experts they pick.
k' = 2, 4, 6 of 8 decode speed is `moetailor bench decode --model synthetic --top-k 2,4,6 --keep ''`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def route_overhead(tokens: list[int], repeats: int = 200, E: int = 64, k: int = 8, D: int = 32) -> list[dict]:
    """Microseconds per call of the one routing function for one layer (OLMoE-like semantics, m=64,
    top-8): what folding adds to a step beyond the expert reads, independent of memory traffic."""
    from moetailor.models.architectures import RouterSemantics
    from moetailor.routing import FoldTables, LayerPolicy
    from moetailor.routing.router import CompiledPolicy, route

    g = torch.Generator().manual_seed(0)
    sem = RouterSemantics(num_experts=E, top_k=k, scoring="softmax", normalise=False)
    loss = torch.rand(E, E, generator=g)
    tables = FoldTables(scale=torch.rand(E, E, generator=g) * 2, loss=loss.fill_diagonal_(0), mean_norm=torch.rand(E, generator=g))
    keep = tuple(range(0, E, E // D))
    policies = {"full router (stock top-k)": LayerPolicy(top_k=k), "mask (static pool)": LayerPolicy(keep=keep),
                "static drop": LayerPolicy(keep=keep, pool_mode="drop"),
                "static fold": LayerPolicy(keep=keep, pool_mode="fold"),
                "batch drop": LayerPolicy(batch_pool=D, fold=False), "batch fold": LayerPolicy(batch_pool=D),
                "token drop K_pre=4": LayerPolicy(token_keep=4, fold=False),
                "token fold K_pre=4": LayerPolicy(token_keep=4)}
    rows = []
    for T in tokens:
        logits = torch.randn(T, E, generator=g)
        for label, policy in policies.items():
            cp = CompiledPolicy.build(policy, sem, "cpu", tables)
            for _ in range(10):
                route(logits, sem, cp)
            t0 = time.perf_counter()
            for _ in range(repeats):
                route(logits, sem, cp)
            rows.append({"tokens": T, "policy": label, "us_per_layer": (time.perf_counter() - t0) / repeats * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("build/bench/techniques"))
    ap.add_argument("--layers", type=int, default=2, help="MoE layers of the synthetic model (1.6 GB each)")
    ap.add_argument("--pool", type=int, default=32, help="decode budget D (experts per step)")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k-pre", default="6,4,2")
    ap.add_argument("--prompt-lens", default="128,512")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--route-only", action="store_true", help="only the routing-function microbenchmark")
    args = ap.parse_args()
    overhead = route_overhead([8, 64, 512])
    for row in overhead:
        print(f"route() {row['tokens']:>4} tokens  {row['policy']:<26} {row['us_per_layer']:8.1f} us/layer", flush=True)
    if args.route_only:
        return

    from moetailor.bench.measure import engine_decode, make_llm, prompts
    from moetailor.bench.pools import kept_ids
    from moetailor.bench.synthetic import synthetic_model
    from moetailor.calibration import calibrate_batches
    from moetailor.plans.techniques import Shape, fold_decode, fold_prefill, technique_plan
    from moetailor.routing import LayerPolicy, PhasePolicy

    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = synthetic_model(args.layers)
    shape = Shape.of(model)
    stats_path = args.out / "synthetic-fold-stats.safetensors"
    t0 = time.time()
    ids = torch.tensor(prompts(args.calib_tokens // 64, 64, model.config.vocab_size, seed=11))   # [N, 64]
    calibrate_batches(model, [ids[i:i + 8] for i in range(0, len(ids), 8)], fold=True, progress=False).save(stats_path)
    print(f"calibrated synthetic fold tables on {ids.numel()} tokens in {time.time() - t0:.0f} s", flush=True)

    batches = [int(b) for b in args.batches.split(",")]
    keep = kept_ids(shape.num_experts, args.pool / shape.num_experts, shape.top_k)
    static = lambda mode: PhasePolicy.uniform(list(shape.layers), LayerPolicy(keep=keep, pool_mode=mode))  # noqa: E731
    pools = {
        "full": None,
        f"mask {args.pool}": technique_plan(model, decode=static("mask")),
        f"static drop {args.pool}": technique_plan(model, decode=static("drop")),
        f"static fold {args.pool}": technique_plan(model, decode=static("fold"), stats_path=stats_path),
        f"batch drop {args.pool}": technique_plan(model, decode=fold_decode(shape, args.pool, fold=False),
                                                  stats_path=stats_path),
        f"batch fold {args.pool}": technique_plan(model, decode=fold_decode(shape, args.pool), stats_path=stats_path),
    }
    max_len = 16 + args.steps + 4
    llm = make_llm(model, max(batches), max(max_len, max(int(x) for x in args.prompt_lens.split(",")) + 4))
    decode: dict[int, dict[str, list[float]]] = {}
    distinct: dict[int, dict[str, float]] = {}
    for b in batches:
        for r in range(args.repeats):
            for label, plan in pools.items():
                llm.set_plan(plan)
                res = engine_decode(llm, b, 16, args.steps, seed=r)
                decode.setdefault(b, {}).setdefault(label, []).append(res.step_s)
                distinct.setdefault(b, {})[label] = res.distinct
                print(f"batch {b} round {r} {label}: {res.step_s * 1e3:.1f} ms/step, {res.distinct:.1f} experts/layer",
                      flush=True)
    rows = []
    for b in batches:
        med = {l: statistics.median(v) for l, v in decode[b].items()}
        for label, s in med.items():
            rows.append({"batch": b, "pool": label, "step_ms": s * 1e3, "distinct": distinct[b][label],
                         "vs_full": med["full"] / s})
        p = args.pool
        rows.append({"batch": b, "ratio static fold / mask": med[f"static fold {p}"] / med[f"mask {p}"],
                     "ratio static fold / static drop": med[f"static fold {p}"] / med[f"static drop {p}"],
                     "ratio batch fold / batch drop": med[f"batch fold {p}"] / med[f"batch drop {p}"],
                     "ratio batch fold / mask": med[f"batch fold {p}"] / med[f"mask {p}"]})

    from moetailor.engine import SamplingParams
    ttft = []
    ks = [int(k) for k in args.k_pre.split(",")]
    prefill_pools = {"full": None}
    for k in ks:
        prefill_pools[f"drop-prefill:{k}"] = technique_plan(model, prefill=fold_prefill(shape, k, fold=False))
        prefill_pools[f"fold-prefill:{k}"] = technique_plan(model, prefill=fold_prefill(shape, k), stats_path=stats_path)
    for length in (int(x) for x in args.prompt_lens.split(",")):
        times: dict[str, list[float]] = {}
        for r in range(args.repeats):
            for label, plan in prefill_pools.items():
                llm.set_plan(plan)
                llm.step_log.clear()
                llm.generate(prompts(1, length, model.config.vocab_size, seed=100 + r),
                             SamplingParams(max_tokens=1, ignore_eos=True))
                times.setdefault(label, []).append(sum(x.seconds for x in llm.step_log if x.phase == "prefill"))
        full = statistics.median(times["full"])
        for label, v in times.items():
            ttft.append({"prompt_len": length, "pool": label, "ttft_ms": statistics.median(v) * 1e3,
                         "speedup_vs_full": full / statistics.median(v)})
            print(f"prompt {length} {label}: TTFT {statistics.median(v) * 1e3:.1f} ms "
                  f"({full / statistics.median(v):.2f}x vs full)", flush=True)
    llm.set_plan(None)
    result = {"route_overhead_us": overhead, "decode": rows, "ttft": ttft, "settings": vars(args) | {"out": str(args.out)},
              "threads": torch.get_num_threads()}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    for row in rows:
        print(json.dumps(row))
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
