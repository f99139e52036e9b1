"""Decode step time of the default (eager) engine beside `LLM(compile_decode=True)` (torch.compile of
the module path), in one process, alternating round by round, on the bundled model or any checkpoint.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/compile_decode_ab.py
    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/compile_decode_ab.py --model build/olmoe4 \
        --dtype bf16 --batches 1 8 32 --prompt-len 32 --new-tokens 16 --rounds 4

Time per step = (t(N tokens) - t(1 token)) / (N - 1) after held-out prompts, EOS ignored, 2 threads, after
one warm-up generation each (the compiled engine compiles there). Printed: the best of the rounds and the
median of the per-round ratios (this machine's speed drifts within minutes; a round has both engines).
On the bundled fp32 model the default is the lean forward (decode_forward.py), on a bf16 or non-Qwen
checkpoint transformers' modules.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import heldout_prompts   # noqa: E402


def step_ms(llm, prompts, full, one) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, one)
    t1 = time.perf_counter()
    llm.generate(prompts, full)
    t2 = time.perf_counter()
    return 1000 * ((t2 - t1) - (t1 - t0)) / (full.max_tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from moetailor.engine import LLM, SamplingParams

    torch.set_num_threads(2)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    kw = dict(dtype=dtype, max_num_seqs=max(args.batches), max_model_len=args.prompt_len + args.new_tokens + 8)
    engines = {"eager (default)": LLM(args.model, **kw), "compile_decode": LLM(args.model, compile_decode=True, **kw)}
    full = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    print(f"{args.model} {args.dtype}; the default engine's decode: "
          f"{'lean forward' if engines['eager (default)'].runner.lean is not None else 'transformers modules'}")
    for batch in args.batches:
        prompts = heldout_prompts(engines["compile_decode"].tokenizer, batch, args.prompt_len)
        for llm in engines.values():
            llm.generate(prompts, full)   # warm-up (the compiled engine compiles here)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for rnd in range(args.rounds):
            order = list(engines.items()) if rnd % 2 == 0 else list(engines.items())[::-1]
            for name, llm in order:
                times[name].append(step_ms(llm, prompts, full, one))
        eager, compiled = times.values()
        ratio = statistics.median(e / c for e, c in zip(eager, compiled))
        print(f"batch {batch}: " + ", ".join(f"{n} {min(ms):.2f} ms/step ({1000 * batch / min(ms):.1f} tok/s)"
                                            for n, ms in times.items())
              + f"; eager / compiled per round: median {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
