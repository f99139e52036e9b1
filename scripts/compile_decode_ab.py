"""Decode step time of the default (lean, eager) engine beside `LLM(compile_decode=True)` (torch.compile of
the module path), in one process, alternating, best of 3, on the bundled model.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/compile_decode_ab.py

Time per step = (t(64 tokens) - t(1 token)) / 63 after 48-token held-out prompts, EOS ignored, 2 threads,
after one warm-up generation each (the compiled engine compiles there).
"""
from __future__ import annotations

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
    from moetailor.engine import LLM, SamplingParams

    torch.set_num_threads(2)
    engines = {"lean eager (default)": LLM("reference"), "compile_decode": LLM("reference", compile_decode=True)}
    full, one = SamplingParams(max_tokens=64, ignore_eos=True), SamplingParams(max_tokens=1, ignore_eos=True)
    for batch in (1, 8):
        prompts = heldout_prompts(engines["compile_decode"].tokenizer, batch, 48)
        for llm in engines.values():
            llm.generate(prompts, full)   # warm-up (the compiled engine compiles here)
        best: dict[str, float] = {}
        for rnd in range(3):
            order = list(engines.items()) if rnd % 2 == 0 else list(engines.items())[::-1]
            for name, llm in order:
                best[name] = min(best.get(name, float("inf")), step_ms(llm, prompts, full, one))
        print(f"batch {batch}: " + ", ".join(f"{n} {ms:.2f} ms/step ({1000 * batch / ms:.0f} tok/s)"
                                            for n, ms in best.items()), flush=True)


if __name__ == "__main__":
    main()
