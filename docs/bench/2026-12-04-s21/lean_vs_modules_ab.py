"""The lean decoder beside transformers' modules, batch-1 decode step time, one process, rounds alternating.

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-04-s21/lean_vs_modules_ab.py tiny
    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-04-s21/lean_vs_modules_ab.py build/olmoe4
"""
import sys, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))   # engine_vs_hf (the repo's scripts/)
from moetailor.engine import LLM, SamplingParams
from moetailor.models.tiny import tiny_model
torch.set_num_threads(2)
def bench(llm, ids, n=150, rounds=3):
    full, one = SamplingParams(max_tokens=n, ignore_eos=True), SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(ids, full); out = []
    for r in range(rounds):
        t0 = time.perf_counter(); llm.generate(ids, one); t1 = time.perf_counter(); llm.generate(ids, full); t2 = time.perf_counter()
        out.append(((t2 - t1) - (t1 - t0)) / (n - 1) * 1e3)
    return out
which = sys.argv[1]
if which == "tiny":
    for arch in ("olmoe", "qwen2_moe"):
        m = tiny_model(arch, num_experts=64, top_k=8, layers=4, hidden=128).to(torch.bfloat16)
        a, b = LLM(m, lean_decode=False, max_model_len=250), LLM(m, max_model_len=250)
        assert b.runner.lean is not None
        ids = [[5, 6, 7, 8] * 8]
        print(arch, "bf16 module path ms", [round(x, 3) for x in bench(a, ids)], "lean", [round(x, 3) for x in bench(b, ids)])
else:
    from engine_vs_hf import heldout_prompts
    lean = LLM(which, dtype="bfloat16", max_model_len=100)
    print("lean", lean.runner.lean is not None)
    prompts = heldout_prompts(lean.tokenizer, 1, 32)
    mod = LLM(lean.model, dtype="bfloat16", max_model_len=100, lean_decode=False)
    for r in range(4):
        for name, llm in (("lean", lean), ("modules", mod)) if r % 2 == 0 else (("modules", mod), ("lean", lean)):
            print(name, round(min(bench(llm, prompts, 24, 1)), 2), "ms/step", flush=True)
