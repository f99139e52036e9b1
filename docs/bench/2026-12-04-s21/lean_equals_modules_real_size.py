"""A bf16 checkpoint's greedy tokens and logprobs through the lean decoder and through transformers' modules.

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-04-s21/lean_equals_modules_real_size.py build/olmoe4
"""
import sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))   # engine_vs_hf (the repo's scripts/)
from engine_vs_hf import heldout_prompts
from moetailor.engine import LLM, SamplingParams
torch.set_num_threads(2)
path = sys.argv[1]
lean = LLM(path, dtype="bfloat16", max_model_len=80)
mod = LLM(lean.model, dtype="bfloat16", max_model_len=80, lean_decode=False)
assert lean.runner.lean is not None and mod.runner.lean is None
for B in (1, 8, 32):
    prompts = heldout_prompts(lean.tokenizer, B, 32)
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    a, b = lean.generate(prompts, p), mod.generate(prompts, p)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    lp = all(x.logprobs == y.logprobs for x, y in zip(a, b))
    print(f"{path} batch {B}: identical tokens {same}/{B}, identical logprobs {lp}", flush=True)
