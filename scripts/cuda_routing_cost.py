"""What the vLLM plugin's routing op costs per MoE layer on a GPU, against stock top-k routing, each
captured in a CUDA graph (what vLLM replays on a GPU) and replayed back to back.

    python scripts/cuda_routing_cost.py --out build/cuda-routing.json     # needs a CUDA device

Stock: softmax over the router logits, top-k, renormalise (vLLM's ``fused_topk`` in plain torch ops).
moetailor: ``integrations.vllm.routing.step_routes`` (the body of ``torch.ops.moetailor.step_routes``)
with one policy in decode and the full router in prefill, on a step of decode tokens with budgets.
Shapes are router logits [T, E] at a model's E and k; fold tables random (their values do not
change the work). Prints µs per layer per call and the ratio to stock. ``--compiled`` also times the
same body through ``torch.compile`` (Inductor fuses its elementwise ops; the plugin does not do this
yet: it measures what fusing would give).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moetailor.integrations.vllm.routing import LayerRouting, step_routes
from moetailor.models.architectures import RouterSemantics
from moetailor.routing import CompiledPolicy, FoldTables, LayerPolicy

SHAPES = {"olmoe-1b-7b": (64, 8), "qwen3-30b-a3b": (128, 8)}   # E, k


def policies(E: int, k: int) -> dict[str, LayerPolicy]:
    pool = tuple(range(0, E, 2))
    return {"full (budgets only)": LayerPolicy(), "mask 50%": LayerPolicy(keep=pool),
            "fold 50%": LayerPolicy(keep=pool, pool_mode="fold"), "skip 0.3": LayerPolicy(skip_beta=0.3),
            f"token top-{k // 2} folded": LayerPolicy(token_keep=k // 2),
            f"batch pool {E // 2} folded": LayerPolicy(batch_pool=E // 2)}


def timed(fn, reps: int) -> float:
    """µs per call of ``fn`` captured in one CUDA graph and replayed ``reps`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="build/cuda-routing.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--compiled", action="store_true", help="also the body under torch.compile (a compile per case)")
    args = ap.parse_args()
    if args.compiled:
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = 256   # one graph per (policy, T): this script only
    dev, rows = "cuda", []
    for shape in args.shapes:
        E, k = SHAPES[shape]
        sem = RouterSemantics(num_experts=E, top_k=k, scoring="softmax", normalise=True)
        g = torch.Generator(device=dev).manual_seed(0)
        tables = FoldTables(torch.rand(E, E, device=dev, generator=g) * 1.5, torch.rand(E, E, device=dev, generator=g),
                            torch.rand(E, device=dev, generator=g) + 0.5)
        full = CompiledPolicy.build(LayerPolicy(), sem, dev, tables)
        for T in args.tokens:
            logits = torch.randn(T, E, device=dev, generator=g)                       # [T, E]
            live, decode = torch.ones(T, dtype=torch.bool, device=dev), torch.ones(T, dtype=torch.bool, device=dev)
            token_k = torch.randint(1, k + 1, (T,), device=dev, generator=g)          # [T] budgets

            def stock():
                w, i = torch.softmax(logits.float(), -1).topk(k, -1)
                return w / w.sum(-1, keepdim=True), i
            base = timed(stock, args.reps)
            rows.append(dict(shape=shape, tokens=T, policy="stock top-k", us=base, ratio=1.0))
            for name, policy in policies(E, k).items():
                lr = LayerRouting(sem, full, CompiledPolicy.build(policy, sem, dev, tables), k)
                us = timed(lambda: step_routes(logits, lr, live, decode, token_k), args.reps)
                rows.append(dict(shape=shape, tokens=T, policy=name, us=us, ratio=us / base))
                if args.compiled:
                    fused = torch.compile(step_routes, fullgraph=True, dynamic=False)
                    torch.testing.assert_close(fused(logits, lr, live, decode, token_k)[0],
                                               step_routes(logits, lr, live, decode, token_k)[0])
                    us = timed(lambda: fused(logits, lr, live, decode, token_k), args.reps)
                    rows.append(dict(shape=shape, tokens=T, policy=name + " (compiled)", us=us, ratio=us / base))
            for r in rows[-len(policies(E, k)) * (2 if args.compiled else 1) - 1:]:
                print(f"{r['shape']:>14} T={r['tokens']:>4} {r['policy']:>24}: {r['us']:7.1f} µs  {r['ratio']:5.2f}x stock",
                      flush=True)
    device = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=device, torch=torch.__version__, rows=rows), indent=1))
    print(f"{device}, torch {torch.__version__}: wrote {args.out}")


if __name__ == "__main__":
    main()
