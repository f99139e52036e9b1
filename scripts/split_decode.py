"""Decode speed of a split (sub-expert) checkpoint beside its original, in one run.

For each batch and budget (the full k, 1/2 and 1/4 of it: k and N*k sub-experts route the same
neurons), both models decode the same seeded prompts through the engine, alternating model by model
for ``--repeats`` rounds so that noise on a shared machine hits both alike; the table gives each
side's median step over all rounds and the split / original step-time ratio.

    python scripts/split_decode.py --split build/split4            # a `moetailor split reference --parts 4` checkpoint
    python scripts/split_decode.py --parts 4                        # writes one first (random grouping, a few seconds)
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def build_split(original: str, parts: int, out: Path) -> Path:
    """A split checkpoint of ``original`` (random neuron grouping: its speed does not depend on the grouping)."""
    subprocess.run([sys.executable, "-m", "moetailor.cli.main", "split", original, "--parts", str(parts),
                    "--method", "random", "--data", "text", "--tokens", "2048", "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--original", default="reference")
    ap.add_argument("--split", help="the split checkpoint (default: write one of --original in --parts)")
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per cell and round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--out", default=None, help="also write the table to this JSON file (scripts/benchmarks.sh)")
    args = ap.parse_args()

    from moetailor import kernels
    from moetailor.bench.measure import engine_decode, make_llm
    from moetailor.models.adapters import moe_layers
    from moetailor.models.loading import load_model

    with tempfile.TemporaryDirectory() as tmp:
        split = args.split or build_split(args.original, args.parts, Path(tmp) / "split")
        llms = {}
        for label, path in (("original", args.original), ("split", str(split))):
            model = load_model(path, dtype=torch.float32)
            llms[label] = make_llm(model, max(args.batches), args.prompt_len + args.steps + 4,
                                   pack_weights=kernels.packed_weights_pay())
        full = {label: moe_layers(llm.model)[0].top_k for label, llm in llms.items()}
        lean = {label: llm.runner.decoder is not None and llm.runner.decoder.graph is not None for label, llm in llms.items()}
        print(f"top-k: original {full['original']}, split {full['split']}; engine decoder with the bound graph: {lean}")
        for llm in llms.values():   # untimed: the first steps in a process pay one-off set-up costs
            engine_decode(llm, max(args.batches), args.prompt_len, 4)
        times: dict[tuple, list[float]] = {}
        for _ in range(args.repeats):
            for b in args.batches:
                for share in (1, 2, 4):
                    for label, llm in llms.items():
                        k = max(1, full[label] // share)
                        r = engine_decode(llm, b, args.prompt_len, args.steps, expert_top_k=None if share == 1 else k)
                        times.setdefault((b, share, label), []).append(r.step_s)
    from moetailor.bench.page import Table, write_tables
    from moetailor.tables import markdown_table

    rows = []
    for b in args.batches:
        for share in (1, 2, 4):
            o, s = (statistics.median(times[(b, share, label)]) for label in ("original", "split"))
            rows.append([b, "full" if share == 1 else f"1/{share}", max(1, full["original"] // share), round(b / o),
                         max(1, full["split"] // share), round(b / s), f"{s / o:.2f}x"])
    table = Table(f"split ({args.parts} parts) vs original decode step, median of {args.repeats} rounds of "
                  f"{args.steps} steps, {torch.get_num_threads()} threads",
                  ["batch", "budget", "orig k", "orig tok/s", "split k", "split tok/s", "split/orig step"], rows)
    print(markdown_table(table.columns, table.rows))
    if args.out:
        write_tables(args.out, [table], times={f"{b}/{share}/{label}": v for (b, share, label), v in times.items()})

if __name__ == "__main__":
    main()
