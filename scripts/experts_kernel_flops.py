"""The native experts kernel at OLMoE-1B-7B's expert shapes: its read rate against a plain read, and its FLOP/s.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/experts_kernel_flops.py [--dtype bfloat16]

64 experts of hidden 2048 x width 1024, top-8, T tokens routed by a skewed softmax over all 64
(``--pool P``: uniformly over the first P), the weights of ``--layers`` layers called in turn so that
every call reads memory, as in a decode step (4 layers of bf16 experts are 3.2 GB). Per T: ms per
layer (best of 5 rounds), the distinct experts' bytes per second beside the yardstick (an fp32 ``sum`` over
1 GiB, ``bench.bandwidth.read_bandwidth``, timed right after it: what reading memory costs with no
arithmetic; the same yardstick as ``scripts/scale.py decode-one``), and
GFLOP/s, with torch's 2048-cube fp32 ``mm`` at the end. At batch 1-8 the kernel should read at the
yardstick's rate; at 32-64 a layer's arithmetic (T x 8 routes) starts to show. ``--layout both``
times the row-major weights and the same weights packed (``kernels.pack_weight``, what the
engine holds on AVX-512) in alternating rounds, and prints packed / row-major.
"""
from __future__ import annotations

import argparse
import time

import torch


def best_s(fn, rounds: int = 5) -> float:
    return best_each({"": fn}, rounds)[""]


def best_each(fns: dict, rounds: int = 5) -> dict:
    """Best time of each function, called in turn every round (so each sees the same machine)."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def routes(tokens: int, experts: int, k: int, pool: int | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weight) [T, K] of T tokens: uniformly over the first `pool` experts, else a skewed
    softmax over all of them."""
    if pool:
        index = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(tokens)])
        weight = torch.rand(tokens, k, generator=g)
    else:
        weight, index = torch.softmax(2 * torch.randn(tokens, experts, generator=g), -1).topk(k, -1)
    return index.contiguous(), weight.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--pool", type=int, default=None, help="route uniformly over the first P experts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", default="both", choices=["row-major", "packed", "both"])
    args = ap.parse_args()
    from moetailor import kernels
    from moetailor.bench.bandwidth import read_bandwidth

    torch.set_num_threads(args.threads)
    experts = kernels.swiglu_experts()
    if experts is None:
        raise SystemExit("the native kernels did not build here")
    E, H, I, K = 64, 2048, 1024, 8
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    layers = [((torch.randn(E, 2 * I, H, generator=g) * 0.02).to(dtype), (torch.randn(E, H, I, generator=g) * 0.02).to(dtype))
              for _ in range(args.layers)]
    layouts = {}
    if args.layout != "packed":
        layouts["row-major"] = layers
    if args.layout != "row-major":
        layouts["packed"] = [tuple(kernels.pack_weight(w) for w in layer) for layer in layers]
    if args.layout == "packed":
        del layers
    read = torch.zeros(args.layers, dtype=torch.int64)

    for T in args.tokens:
        x = torch.randn(T, H, generator=g)
        index, weight = routes(T, E, K, args.pool, g)

        def step(weights) -> None:
            for layer, (gate_up, down) in enumerate(weights):
                experts(x, gate_up, down, index, weight, read, layer)

        best = best_each({name: (lambda w=w: step(w)) for name, w in layouts.items()})
        yardstick = read_bandwidth() / 1e9
        n = int(read[0])
        for name, seconds in best.items():
            per_layer = seconds / args.layers
            rate = n * 3 * H * I * dtype.itemsize / per_layer / 1e9
            print(f"{args.dtype} {name:9s} T={T:3d}: {per_layer * 1e3:6.2f} ms per layer, {n:2d} experts read, "
                  f"{rate:5.1f} GB/s (yardstick {yardstick:5.1f}: {100 * rate / yardstick:3.0f}%), "
                  f"{T * K * 3 * H * I * 2 / per_layer / 1e9:6.1f} GFLOP/s", flush=True)
        if len(best) == 2:
            print(f"  packed / row-major: {best['row-major'] / best['packed']:.2f}x faster", flush=True)
    a = torch.randn(2048, 2048)
    print(f"torch mm 2048^3 (fp32): {2 * 2048 ** 3 / best_s(lambda: a @ a) / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
