import sys, torch
sys.path.insert(0, "/work/main/scripts")
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
