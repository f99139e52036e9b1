"""Prefill time of one engine holding its weights packed beside one holding the checkpoint's layout.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/packed_vs_row_major.py --model build/olmoe4 --dtype bfloat16

Both engines in one process (the weights twice in memory), called in turn each round, so both see
the same machine: ``LLM(pack_weights=None)`` (what ``moetailor serve`` runs: the experts packed for the
native kernel where that pays, and the bf16 linear layers where torch's bf16 GEMM has no hardware) and
``LLM(pack_weights=False)``. Prints each round's prefill of B prompts of L tokens and the best-round
ratio. Decode against the read floor: ``scripts/scale.py decode-one`` with and without ``--row-major``.
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
    args = ap.parse_args()
    from moetailor.engine import LLM, SamplingParams
    from moetailor.models.loading import load_tokenizer

    torch.set_num_threads(2)
    prompts = heldout_prompts(load_tokenizer(args.model), args.batch, args.prompt_len)
    kw = dict(dtype=args.dtype, max_num_seqs=args.batch, max_model_len=args.prompt_len + 16)
    engines = {"packed": LLM(args.model, **kw), "row-major": LLM(args.model, pack_weights=False, **kw)}
    best = {name: float("inf") for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            llm.step_log.clear()
            llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
            seconds = sum(s.seconds for s in llm.step_log if s.phase == "prefill")
            best[name] = min(best[name], seconds)
            print(f"{name:9s} round {r}: prefill of {args.batch} x {args.prompt_len} tokens {seconds * 1e3:.0f} ms "
                  f"({args.batch * args.prompt_len / seconds:.0f} tok/s)", flush=True)
    print(f"packed / row-major prefill: {best['row-major'] / best['packed']:.2f}x faster (best rounds)")


if __name__ == "__main__":
    main()
