"""A bf16 checkpoint's decode step: the lean loop in C++ (the bound DecodeGraph / decode_layer ops) against the
same loop in Python, one process, rounds alternating. Median decode-step ms from the engine's step log.

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-05-s22/bf16_graph_ab.py tiny
    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-05-s22/bf16_graph_ab.py build/olmoe4
"""
import dataclasses, statistics, sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))   # engine_vs_hf (the repo's scripts/)
from engine_vs_hf import heldout_prompts
from moetailor.engine import LLM, SamplingParams
from moetailor.models.tiny import tiny_model
torch.set_num_threads(2)
which = sys.argv[1]
if which == "tiny":
    engines = {arch: LLM(tiny_model(arch, seed=1).to(torch.bfloat16), max_model_len=256) for arch in ("olmoe", "qwen3_moe")}
    new_tokens, rounds = 120, 4
    prompts = {arch: [[5 + i for i in range(16)]] for arch in engines}
else:
    llm = LLM(which, dtype="bfloat16", max_model_len=96, max_num_seqs=8)
    engines, new_tokens, rounds = {which: llm}, 24, 6
    prompts = {which: heldout_prompts(llm.tokenizer, 1, 32)}
for name, llm in engines.items():
    native = llm.runner.lean
    assert native.graph is not None, "no bound graph: nothing to compare"
    python = dataclasses.replace(native, layer_ops=None, graph=None)
    res = {"C++": [], "Python": []}
    for r in range(rounds):
        for label, lean in ((("C++", native), ("Python", python)) if r % 2 == 0 else (("Python", python), ("C++", native))):
            llm.runner.lean = lean
            llm.step_log.clear()
            llm.generate(prompts[name], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
            res[label].append(statistics.median(s.seconds for s in llm.step_log if s.phase == "decode") * 1e3)
    llm.runner.lean = native
    c, p = statistics.median(res["C++"]), statistics.median(res["Python"])
    print(f"{name}: batch-1 decode step, median of {rounds} rounds: C++ {c:.3f} ms, Python {p:.3f} ms "
          f"(Python / C++ {p / c:.2f}x); rounds C++ {['%.2f' % x for x in res['C++']]} Python {['%.2f' % x for x in res['Python']]}")
