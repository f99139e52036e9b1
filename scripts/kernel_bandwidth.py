"""How close the decode kernels read to the machine's read bandwidth, cold, side by side in one run.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/kernel_bandwidth.py [--threads 2]

Every call reads weights that are not in cache (~100 MB of copies, beyond the L3): `rows_linear` at
one row on the reference model's LM head (8192 x 256) and q|k|v projection (512 x 256) shapes, the
experts kernel at one token routed to k of 64 experts (256 x 48, fp32), against a plain `sum` over
the same bytes (what reading memory costs with no arithmetic). GB/s, best of 5 rounds.
"""
from __future__ import annotations

import argparse
import time

import torch


def best_s(fn, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from moetailor import kernels
    from moetailor.tables import print_table

    torch.set_num_threads(args.threads)
    linear, experts = kernels.rows_linear(), kernels.swiglu_experts()
    rows = []
    for name, shape, copies in (("LM head", (8192, 256), 12), ("q|k|v", (512, 256), 200)):
        ws = [torch.randn(*shape) for _ in range(copies)]
        x = torch.randn(1, shape[1])
        gb = sum(w.numel() * 4 for w in ws) / 1e9
        kernel = gb / best_s(lambda: [linear(x, w) for w in ws])
        plain = gb / best_s(lambda: [w.sum() for w in ws])
        rows.append((f"rows_linear, {name} {shape[0]}x{shape[1]}", f"{kernel:.1f}", f"{plain:.1f}", f"{kernel / plain:.2f}"))
    E, H, I = 64, 256, 48
    layers = [(torch.randn(E, 2 * I, H), torch.randn(E, H, I)) for _ in range(12)]   # 113 MB
    read = torch.full((1,), -1, dtype=torch.long)
    for k in (1, 8):
        x, weight = torch.randn(1, H), torch.rand(1, k)
        gb = len(layers) * k * 3 * H * I * 4 / 1e9
        picks = iter([[torch.randperm(E)[:k][None] for _ in layers] for _ in range(6)])   # best_s runs fn 6 times
        rounds = iter(range(6))

        def routed():   # each round other experts (a step reads ~14 MB of a 113 MB pool: not the last round's)
            for (gu, down), index in zip(layers, next(picks)):
                experts(x, gu, down, index, weight, read, 0)

        def plain():    # as many bytes: a block of k experts per layer, at another offset each round
            first = next(rounds) * k % (E - k + 1)
            for gu, down in layers:
                gu[first:first + k].sum(), down[first:first + k].sum()

        kernel, base = gb / best_s(routed), gb / best_s(plain)
        rows.append((f"swiglu_experts, 1 token, k={k}", f"{kernel:.1f}", f"{base:.1f}", f"{kernel / base:.2f}"))
    print_table(f"cold reads, GB/s, {args.threads} threads", ["kernel", "kernel GB/s", "sum GB/s", "kernel / sum"], rows)


if __name__ == "__main__":
    main()
