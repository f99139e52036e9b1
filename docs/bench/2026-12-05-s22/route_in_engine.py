"""Time of the routing call per layer inside engine decode steps (a bf16 checkpoint): native vs stock router.

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-05-s22/route_in_engine.py build/olmoe4
"""
import statistics, sys, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from engine_vs_hf import heldout_prompts
from moetailor.engine import LLM, SamplingParams
from moetailor.models.adapters import moe_layers
torch.set_num_threads(2)
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=80, max_num_seqs=8)
layers = moe_layers(llm.model)
ctl = llm.controller
inner = ctl._route
times = []
def timed(*a, **k):
    t = time.perf_counter(); out = inner(*a, **k); times.append(time.perf_counter() - t); return out
ctl._route = timed
for batch in (1, 8):
    prompts = heldout_prompts(llm.tokenizer, batch, 32)
    res = {True: [], False: []}
    for rnd in range(6):
        for native in (True, False):
            for l in layers: l.router._moetailor_native = native
            llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))   # the prefill's calls
            times.clear()
            llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
            dec = sorted(times)[: len(times) - len(layers)]   # drop the prefill's (largest) calls
            res[native].append(statistics.median(dec) * 1e6)
    print(f"batch {batch}: routing call per layer, median us: native {statistics.median(res[True]):.0f} "
          f"stock {statistics.median(res[False]):.0f}")
