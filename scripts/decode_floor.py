"""Decode against the bandwidth floor, per expert weight format, side by side in one run.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/decode_floor.py --batches 1 8 --layers 1 --experts 32

The synthetic bandwidth-bound model (OLMoE-1B-7B layer shapes, seeded random weights, built in memory)
decodes through the engine with its fp32 expert weights (with the native kernels, and with torch's
ops only) and with a bf16 decode copy (``LLM(decode_expert_dtype=torch.bfloat16)``); for each, per batch: median decode step, bytes a step
reads (routed experts measured by the engine, plus the other weights and the KV cache) and that as a
share of the machine's read bandwidth (``torch.sum`` over 1 GiB, measured in the same run). The
GEMV-format probe (``moetailor.bench.kernels``) runs first, so the kernel ceiling sits beside each
step.
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=1, help="MoE layers of the synthetic model (1.6 GB of fp32 experts each)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer (25 MB each in fp32)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--probe-experts", type=int, default=12)
    ap.add_argument("--out", default=None, help="also write the tables to this JSON file (scripts/benchmarks.sh)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from moetailor.bench.bandwidth import read_bandwidth
    from moetailor.bench.kernels import probe
    from moetailor.bench.measure import engine_decode, make_llm
    from moetailor.bench.synthetic import synthetic_model

    read_bw = read_bandwidth()
    print(json.dumps({"read_gb_s": round(read_bw / 1e9, 1), "threads": torch.get_num_threads()}), flush=True)
    probes = []
    for r in probe(formats=("fp32", "bf16"), rows=args.batches, experts=args.probe_experts):
        probes.append({"probe": r["format"], "rows": r["rows"], "ms_per_expert": round(r["ms_per_expert"], 3),
                       "weight_gb_s": round(r["weight_gb_s"], 2), "of_read_bw": round(r["weight_gb_s"] * 1e9 / read_bw, 3)})
        print(json.dumps(probes[-1]), flush=True)
    model = synthetic_model(layers=args.layers, experts=args.experts)
    max_len = args.prompt_len + args.steps + 4
    rows = []
    for name, dtype, native in (("fp32", None, True), ("fp32, torch ops", None, False), ("bf16", torch.bfloat16, True)):
        llm = make_llm(model, max(args.batches), max_len)
        if dtype is not None or not native:
            from moetailor.serving import LLM
            llm = LLM(model, max_num_seqs=llm.config.max_num_seqs, num_kv_blocks=llm.config.num_kv_blocks,
                      max_model_len=llm.config.max_model_len, decode_expert_dtype=dtype, native_kernels=native)
        engine_decode(llm, 1, args.prompt_len, 2)                              # warm-up
        for b in args.batches:
            r = engine_decode(llm, b, args.prompt_len, args.steps)
            row = {"weights": name, "batch": b, "step_ms": round(1e3 * r.step_s, 2),
                   "tok_s": round(r.tokens_per_s, 1), "distinct_per_layer": round(r.distinct, 1),
                   "gb_per_step": round(r.total_bytes / 1e9, 3), "gb_s": round(r.bandwidth / 1e9, 2),
                   "of_read_bw": round(r.bandwidth / read_bw, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
    from moetailor.bench.page import Table, write_tables
    from moetailor.tables import markdown_table

    fp32 = {r["batch"]: r for r in rows if r["weights"] == "fp32"}
    steps = Table(f"decode step per expert weight format; read bandwidth {read_bw / 1e9:.1f} GB/s (torch.sum over 1 GiB), "
                  f"{torch.get_num_threads()} threads, {args.layers} MoE layer(s) of {args.experts} experts",
                  ["batch", "weights", "step ms", "tok/s", "GB read/step", "GB/s", "of read BW", "speed vs fp32"],
                  [[r["batch"], r["weights"], r["step_ms"], r["tok_s"], r["gb_per_step"], r["gb_s"],
                    f"{100 * r['of_read_bw']:.0f}%", f"{fp32[r['batch']]['step_ms'] / r['step_ms']:.2f}x"] for r in rows])
    gemv = Table("torch F.linear per expert (the GEMV torch-op decode uses)",
                 ["format", "rows", "ms per expert", "GB/s", "of read BW"],
                 [[p["probe"], p["rows"], p["ms_per_expert"], p["weight_gb_s"], f"{100 * p['of_read_bw']:.0f}%"]
                  for p in probes])
    print("\n" + markdown_table(steps.columns, steps.rows))
    if args.out:
        write_tables(args.out, [steps, gemv], read_gb_s=round(read_bw / 1e9, 2), rows=rows, probes=probes)


if __name__ == "__main__":
    main()
