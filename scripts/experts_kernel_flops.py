"""The native experts kernel on the synthetic model's expert shapes: bytes read and FLOP/s per call.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/experts_kernel_flops.py

64 experts of hidden 2048 x width 1024 (OLMoE-1B-7B's, fp32), top-8, T tokens routed uniformly over
a pool of the first P experts, best of 5 calls. At large batch a decode step is compute-bound: a
pool moves the same T x k routes through fewer experts, so it saves bytes and not FLOPs; this
shows how close the kernel is to the GEMM peak (printed beside it: torch's 2048-cube `mm`).
"""
from __future__ import annotations

import time

import torch


def main() -> None:
    from moetailor import kernels

    torch.set_num_threads(2)
    experts = kernels.swiglu_experts()
    if experts is None:
        raise SystemExit("the native kernels did not build here")
    E, H, I, K = 64, 2048, 1024, 8
    torch.manual_seed(0)
    gate_up, down = torch.randn(E, 2 * I, H) * 0.02, torch.randn(E, H, I) * 0.02
    read = torch.full((1,), -1)
    for T, pool in ((8, 64), (32, 64), (32, 32), (64, 32)):
        x, weight = torch.randn(T, H), torch.rand(T, K)
        index = torch.stack([torch.randperm(pool)[:K] for _ in range(T)])
        experts(x, gate_up, down, index, weight, read, 0)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            experts(x, gate_up, down, index, weight, read, 0)
            best = min(best, time.perf_counter() - t0)
        n = int(read[0])
        print(f"T={T} pool={pool}: {best * 1e3:6.1f} ms, {n} experts read, {n * 3 * H * I * 4 / best / 1e9:5.1f} GB/s, "
              f"{T * K * 3 * H * I * 2 / best / 1e9:5.1f} GFLOP/s")
    a = torch.randn(2048, 2048)
    a @ a
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    print(f"torch mm 2048^3: {2 * 2048 ** 3 * 5 / (time.perf_counter() - t0) / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
