"""One process, rounds in turn: llama.cpp's batch-1 step on build/olmoe4 (bf16 GGUF), the engine's, and
moetailor's experts and LM-head ops alone on other copies of those shapes, with torch.sum beside them, each
as GB/s of the bytes a batch-1 step must read (743 MB: 8 of 64 experts, q|k|v|o of 4 layers, the LM head).

    flock /tmp/moetailor-heavy.lock .venv-llamacpp/bin/python docs/bench/2026-12-05-s22/lcpp_vs_engine_ops.py

Needs build/olmoe4 (`moetailor synth olmoe-1b-7b --layers 4 --out build/olmoe4`) and the GGUF that
scripts/llamacpp_vs_engine.py --model build/olmoe4 --dtype bf16 writes.
"""
import time, torch
from llama_cpp import Llama
from moetailor import kernels
torch.set_num_threads(2)
m = Llama(model_path="build/llamacpp_vs_engine/olmoe4-unnormalised-bf16.gguf", n_threads=2, n_ctx=256, verbose=False)
toks = m.tokenize(b"The quick brown fox jumps over the lazy dog and")
STEP_BYTES = 4 * (8 * 3 * 2048 * 1024 + 4 * 2048 * 2048) * 2 + 50304 * 2048 * 2
def lcpp():
    m.reset(); m.eval(toks); t1 = time.perf_counter()
    for i in range(12): m.eval([toks[i % len(toks)]])
    return STEP_BYTES / ((time.perf_counter() - t1) / 12) / 1e9
E, I, H, K = 64, 1024, 2048, 8
layers = [(kernels.pack_weight(torch.randn(E * 2 * I, H).to(torch.bfloat16)).view(E, 2 * I // 16, H // 2, 16, 2).contiguous(),
           kernels.pack_weight(torch.randn(E * H, I).to(torch.bfloat16)).view(E, H // 16, I // 2, 16, 2).contiguous()) for _ in range(2)]
exp = kernels.swiglu_experts(); lin = kernels.rows_linear(); read = torch.zeros(4, dtype=torch.long); x = torch.randn(1, H)
def experts():
    ts = 0.0
    for i in range(12):
        gu, dn = layers[i % 2]; idx = torch.randperm(E)[:K].view(1, K); w = torch.full((1, K), 1 / K)
        t = time.perf_counter(); exp(x, gu, dn, idx, w, read, 0); ts += time.perf_counter() - t
    return 12 * K * 3 * I * H * 2 / ts / 1e9
heads = [kernels.pack_weight(torch.randn(50304, H).to(torch.bfloat16)) for _ in range(2)]
xb = torch.randn(1, H).to(torch.bfloat16)
def head():
    ts = 0.0
    for i in range(6):
        t = time.perf_counter(); lin(xb, heads[i % 2], None); ts += time.perf_counter() - t
    return 6 * 50304 * H * 2 / ts / 1e9
big = torch.ones(100 << 20)
def sums():
    t = time.perf_counter(); big.sum(); return big.numel() * 4 / (time.perf_counter() - t) / 1e9

import sys, statistics, collections
sys.path.insert(0, "scripts")
from engine_vs_hf import heldout_prompts
from moetailor.engine import LLM, SamplingParams
llm = LLM("build/olmoe4", dtype="bfloat16", max_model_len=96)
r = llm.runner
acc = collections.defaultdict(lambda: [0.0, 0])
inner = r.native_experts
def timed(*a):
    t = time.perf_counter(); out = inner(*a)
    if a[0].shape[0] == 1:                                   # decode calls only (the prefill's read every expert)
        acc["experts"][0] += time.perf_counter() - t; acc["experts"][1] += 1
    return out
r.native_experts = timed
prompts = heldout_prompts(llm.tokenizer, 1, 32)
def engine():
    acc.clear(); llm.step_log.clear()
    llm.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True))
    steps = [x.seconds for x in llm.step_log if x.phase == "decode"][1:]
    n = len(steps) + 1
    ems = acc["experts"][0] / acc["experts"][1] * 1e3 if acc["experts"][1] else None   # None: the step ran in C++
    return STEP_BYTES / statistics.median(steps) / 1e9, ems
print('GB/s of a batch-1 step\'s bytes')
for rnd in range(5):
    e, ems = engine()
    inside = "in C++" if ems is None else f"{8 * 3 * 2048 * 1024 * 2 / ems / 1e6:.1f}"
    print(f"llama.cpp step {lcpp():.1f} GB/s | engine step {e:.1f} GB/s (its experts op {inside}) | experts op {experts():.1f} | LM head op {head():.1f} | torch.sum {sums():.1f}")
