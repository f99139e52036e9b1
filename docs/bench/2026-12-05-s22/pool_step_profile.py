"""Where a decode step of the synthetic model goes, full pool and 50% mask pool, by op (torch profiler over
8 decode steps after the prefill), beside the bench's step times.

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-05-s22/pool_step_profile.py bfloat16 64
"""
import statistics, sys, time, torch
from torch.profiler import profile
from moetailor.bench.synthetic import synthetic_model
from moetailor.bench.measure import make_llm, engine_decode
from moetailor.bench.pools import mask_plan
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16
B = int(sys.argv[2]) if len(sys.argv) > 2 else 32
model = synthetic_model(2).to(dtype)
plan = mask_plan(model, 0.5)
llm = make_llm(model, B, 64, pack_weights=True)
for p in (None, plan):
    llm.set_plan(p)
    r = engine_decode(llm, B, 16, 6)
    print(f"{'mask 50%' if p else 'full'}: step {r.step_s*1e3:.1f} ms")
from moetailor.bench.measure import prompts as make_prompts
from moetailor.engine import SamplingParams
import collections
for label, p in (("mask 50%", plan), ("full", None)):
    llm.set_plan(p)
    seqs = [llm.add_request(q, SamplingParams(max_tokens=12, ignore_eos=True)) for q in make_prompts(B, 16, llm.vocab_size)]
    llm.step(); llm.step()                     # prefill, first decode
    with profile() as prof:
        for _ in range(8): llm.step()
    while llm.has_unfinished(): llm.step()
    tot = collections.Counter()
    for e in prof.key_averages():
        tot[e.key] += e.self_cpu_time_total / 8 / 1000
    total = sum(tot.values())
    print(label, f"decode step (profiled) {total:.1f} ms:", ", ".join(f"{k} {v:.2f}" for k, v in tot.most_common(12)))

