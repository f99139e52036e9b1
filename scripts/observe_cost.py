"""What observing served traffic costs inside vLLM (``additional_config`` ``moetailor_observe``), apart from
the bench's engine-level rows (``moetailor bench vllm --only observe,observe-kernel``).

    flock /tmp/moetailor-heavy.lock .venv-vllm/bin/python scripts/observe_cost.py layer
    VLLM_CPU_CI_ENV=1 flock /tmp/moetailor-heavy.lock .venv-vllm/bin/python scripts/observe_cost.py engines [--idle 1.5] [--same]

``layer``: per MoE layer, microseconds per call (one thread, as vLLM's CPU worker is bound to one core
here; best of 5 rounds), the reference model's shapes (64 experts of hidden 256 x width 48, top-8, packed
fp32 weights) at 1, 8 and 32 tokens: moetailor's experts kernel plain and with the observed side
output (``swiglu_experts_observed``, the op the plugin's experts call), and what the routing op adds
(the full router's routes and their sums, ``LayerObserver.add``).

``engines``: two vLLM engines of the reference model on moetailor's experts kernel in one process, one
observing, timed alternately (5 rounds, the first a warm-up, the best kept; decode tokens/s from
t(64 tokens) - t(1 token) as the bench computes it) at batch 1, 8 and 32. ``--idle S``: wait S seconds
before each switch of engine, as the bench does (an idle vLLM worker busy-polls for 1 s); ``--same``:
two identical engines that do not observe, the protocol's own spread; ``--processes``: each engine's
core and worker in their own processes (vLLM's default), bound to the bench's CPUs.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def best_us(fn) -> float:
    from moetailor.bench.measure import best_us as best

    return best(fn, calls=200, warmup=10)


def layer_costs() -> None:
    import torch

    from moetailor import kernels
    from moetailor.calibration.observe import LayerSums
    from moetailor.integrations.vllm import observe as vllm_observe
    from moetailor.models.architectures import RouterSemantics
    from moetailor.routing.policy import FULL
    from moetailor.routing.router import CompiledPolicy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    E, K, H, I = 64, 8, 256, 48
    sem = RouterSemantics(E, K, "softmax", True)
    gate_up, down = (kernels.pack_weight(torch.randn(*s) * 0.05) for s in ((E, 2 * I, H), (E, H, I)))
    full = CompiledPolicy.build(FULL, sem, "cpu", None)
    print("tokens | experts | + observed | routing op adds   [us per layer]")
    for T in (1, 8, 32):
        x, logits = torch.randn(T, H), torch.randn(T, E)
        weights, index = logits.softmax(-1).topk(K, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
        live = torch.ones(T, dtype=torch.bool)
        armed = torch.ones(1, dtype=torch.long)
        sums = LayerSums(E, K, 64, "cpu", hidden_size=H, native=True)
        obs = vllm_observe.LayerObserver(sem, full, None, sums, armed, 0, kernels.softmax_topk())

        def routing():
            armed.fill_(1)
            obs.add(logits, live, live)
        routing()
        read = torch.zeros(1, dtype=torch.long)
        plain = best_us(lambda: torch.ops.moetailor.swiglu_experts(x, gate_up, down, index, weights, read, -1))
        native = best_us(lambda: torch.ops.moetailor.swiglu_experts_observed(
            x, gate_up, down, index, weights, sums.routes[:T], sums.gates[:T], sums.outputs))
        print(f"{T:6d} | {plain:7.1f} | {native - plain:+10.1f} | {best_us(routing):8.1f}")


def engines(idle: float, same: bool, processes: bool) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if processes else "0"
    if processes:
        from moetailor.bench.vllm import same_cores_for_every_instance

        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = same_cores_for_every_instance()
    from vllm import LLM, SamplingParams

    from moetailor.integrations.vllm.launch import engine_kwargs

    out = Path(tempfile.mkdtemp(prefix="observe-cost-"))
    names = ("plain", "plain again") if same else ("plain", "observing")
    llms = {}
    for name in names:
        observe = out / "observed.safetensors" if name == "observing" else None
        llms[name] = LLM(**engine_kwargs("reference", dtype="float32", kv_cache_mib=256, experts_kernel=True,
                                         observe=observe, max_num_seqs=32, max_model_len=128,
                                         enable_prefix_caching=False, max_num_batched_tokens=2048,
                                         disable_log_stats=True))

    def params(n):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    print(f"decode tok/s, moetailor's experts kernel, idle {idle} s between engines, "
          f"{'processes' if processes else 'one process'}")
    for B in (1, 8, 32):
        reqs = [{"prompt_token_ids": list(range(5 + i, 53 + i))} for i in range(B)]
        best: dict[str, float] = {}
        for rnd in range(5):
            for name in (names if rnd % 2 else names[::-1]):
                time.sleep(idle)
                t0 = time.perf_counter()
                llms[name].generate(reqs, params(1), use_tqdm=False)
                t1 = time.perf_counter()
                llms[name].generate(reqs, params(64), use_tqdm=False)
                t2 = time.perf_counter()
                if rnd:
                    best[name] = min(best.get(name, float("inf")), (t2 - t1) - (t1 - t0))
        tok = {n: B * 63 / s for n, s in best.items()}
        print(f"batch {B:2d}: " + ", ".join(f"{n} {v:.0f}" for n, v in tok.items())
              + f", ratio {tok[names[1]] / tok[names[0]]:.2f}", flush=True)
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("layer", "engines"))
    ap.add_argument("--idle", type=float, default=0.0)
    ap.add_argument("--same", action="store_true")
    ap.add_argument("--processes", action="store_true")
    args = ap.parse_args()
    if args.what == "layer":
        layer_costs()
    else:
        engines(args.idle, args.same, args.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
