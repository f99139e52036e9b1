"""Decode step time of the engine on the bundled model (batch 1 by default), optionally with a torch profile.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/decode_step_time.py [--batch 1 8 32] [--profile]

Time per decode step = (t(64 tokens) - t(1 token)) / 63 after B held-out prompts of 48 tokens (``--prompt-len``), greedy,
EOS ignored, after one warm-up generation. To compare two trees, run it alternately with
``PYTHONPATH=<other worktree>/src`` (one machine, minutes apart: only same-run ratios compare).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import heldout_prompts   # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="weights as loaded: float32, or bfloat16 (a bf16 checkpoint as stored)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes, each timed in turn")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one generation")
    args = ap.parse_args()

    from moetailor.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 8)
    for batch in args.batch:
        prompts = heldout_prompts(llm.tokenizer, batch, args.prompt_len)
        full, one = (SamplingParams(max_tokens=n, ignore_eos=True) for n in (args.new_tokens, 1))
        llm.generate(prompts, full)
        t0 = time.perf_counter()
        llm.generate(prompts, one)
        t1 = time.perf_counter()
        llm.generate(prompts, full)
        t2 = time.perf_counter()
        step_ms = 1000 * ((t2 - t1) - (t1 - t0)) / (args.new_tokens - 1)
        print(f"{args.model}: {step_ms:.2f} ms per batch-{batch} decode step, {1000 * batch / step_ms:.0f} tok/s "
              f"(lean forward: {llm.runner.lean is not None}, rows_linear: {llm.runner.native_linear is not None})")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            llm.generate(prompts, full)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
