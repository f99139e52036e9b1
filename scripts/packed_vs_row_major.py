"""Prefill and decode step time of one engine holding its weights packed beside one holding the checkpoint's layout.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/packed_vs_row_major.py --model build/olmoe4 --dtype bfloat16
    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/packed_vs_row_major.py --model reference --dtype float32 \
        --decode-batches 1 8 32

Both engines in one process (the weights twice in memory), called in turn each round, so both see
the same machine: ``LLM(pack_weights=None)`` (what ``moetailor serve`` runs: the experts packed for the
native kernel where that pays, and the bf16 linear layers where torch's bf16 GEMM has no hardware) and
``LLM(pack_weights=False)``. Prints each round's prefill of B prompts of L tokens and the best-round
ratio; with ``--decode-batches``, the median decode step of each engine at each batch (32 new tokens,
best of the rounds). Decode against the read floor: ``scripts/scale.py decode-one`` with and without
``--row-major``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import heldout_prompts   # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="build/olmoe4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[])
    args = ap.parse_args()
    from moetailor.engine import LLM, SamplingParams
    from moetailor.models.loading import load_tokenizer

    torch.set_num_threads(2)
    batches = max([args.batch, *args.decode_batches])
    prompts = heldout_prompts(load_tokenizer(args.model), batches, args.prompt_len)
    kw = dict(dtype=args.dtype, max_num_seqs=batches, max_model_len=args.prompt_len + 48)
    engines = {"packed": LLM(args.model, **kw), "row-major": LLM(args.model, pack_weights=False, **kw)}
    best = {name: float("inf") for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            llm.step_log.clear()
            llm.generate(prompts[:args.batch], SamplingParams(max_tokens=1, ignore_eos=True))
            seconds = sum(s.seconds for s in llm.step_log if s.phase == "prefill")
            best[name] = min(best[name], seconds)
            print(f"{name:9s} round {r}: prefill of {args.batch} x {args.prompt_len} tokens {seconds * 1e3:.0f} ms "
                  f"({args.batch * args.prompt_len / seconds:.0f} tok/s)", flush=True)
    print(f"packed / row-major prefill: {best['row-major'] / best['packed']:.2f}x faster (best rounds)")
    for b in args.decode_batches:
        step = {name: float("inf") for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                llm.step_log.clear()
                llm.generate(prompts[:b], SamplingParams(max_tokens=33, ignore_eos=True))
                seconds = sorted(s.seconds for s in llm.step_log if s.phase == "decode")[1:]
                step[name] = min(step[name], seconds[len(seconds) // 2])
        print(f"decode batch {b:3d}: packed {step['packed'] * 1e3:.2f} ms, row-major {step['row-major'] * 1e3:.2f} ms "
              f"a step: packed {step['row-major'] / step['packed']:.2f}x faster", flush=True)


if __name__ == "__main__":
    main()
