"""The native CPU kernels against the torch ops they replace, in isolation, side by side in one run.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/native_kernels.py [--threads 1] [--bf16]

Experts: the reference model's shapes (64 experts of hidden 256 x width 48, top-8, fp32 weights),
T tokens routed by a skewed softmax; `kernels.swiglu_experts` vs the grouped-GEMM path
(`torch._grouped_mm` over the routes sorted by expert, as `runtime.experts.grouped_experts_forward`).
Attention: B sequences of S cached positions in scattered 16-token blocks, 4 query / 2 KV heads of
64; `kernels.paged_decode_attention` vs gathering the blocks into a dense copy + SDPA (the engine's
torch-op path). Linear layers of a decode step: `kernels.rows_linear` vs `F.linear` on the reference
model's projection shapes and its LM head, with the weight cached ("hot") and cycling through
96 MB of copies so every call reads memory ("cold", as inside a step). Microseconds per call, best of
5 rounds. ``--bf16``: also bf16 linear layers of OLMoE-1B-7B's shapes (2048 -> 2048 and the 50,304-row LM
head) at 1-64 rows, the native op against torch's bf16 GEMM, with the processor's answer to "does torch
multiply bf16 in hardware" (``kernels.cpu_has_bf16_matmul``; the engine runs the op at every row count
where it says no).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moetailor.bench.measure import best_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bf16", action="store_true", help="also bf16 linear layers of real size, 1-64 rows")
    ap.add_argument("--out", default=None, help="also write the table to this JSON file (scripts/benchmarks.sh)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from moetailor import kernels
    from moetailor.tables import print_table

    experts, attention, linear = kernels.swiglu_experts(), kernels.paged_decode_attention(), kernels.rows_linear()
    if experts is None:
        raise SystemExit("the native kernels did not build here (see the warning above)")
    torch.manual_seed(0)
    E, H, I, K = 64, 256, 48, 8
    gate_up, down = torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05

    def grouped(x, index, weight):
        flat = index.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        offsets = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
        rows = order // K
        g, u = torch._grouped_mm(x[rows], gate_up.transpose(-2, -1), offs=offsets).chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offsets)
        return torch.zeros_like(x).index_add_(0, rows, y * weight.reshape(-1)[order, None])

    read = torch.full((1,), -1)                       # the op writes its distinct-expert count here
    rows = []
    for T in (1, 8, 32, 512):
        x = torch.randn(T, H)
        weight, index = torch.softmax(torch.randn(T, E) + torch.linspace(0, 2, E), -1).topk(K, -1)
        out = experts(x, gate_up, down, index, weight, read, 0)
        torch.testing.assert_close(out, grouped(x, index, weight), rtol=1e-4, atol=1e-5)
        native, torch_ops = best_us(lambda: experts(x, gate_up, down, index, weight, read, 0)), best_us(lambda: grouped(x, index, weight))
        rows.append((f"experts, {T} tokens", f"{torch_ops:.0f}", f"{native:.0f}", f"{torch_ops / native:.1f}x"))
    nH, nKV, D, bs = 4, 2, 64, 16
    k_cache, v_cache = torch.randn(4096 * bs, nKV, D), torch.randn(4096 * bs, nKV, D)
    for B, S in ((1, 60), (32, 60), (32, 500)):
        nb = (S + bs - 1) // bs
        table = torch.randperm(4096)[:B * nb].view(B, nb)
        lengths, q = torch.full((B,), S), torch.randn(B, nH, D)
        slots = (table[:, :, None] * bs + torch.arange(bs)).view(B, -1)[:, :S].flatten()

        def gathered():
            k = k_cache[slots].view(B, S, nKV, D).transpose(1, 2)
            v = v_cache[slots].view(B, S, nKV, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True, scale=D ** -0.5)[:, :, 0]

        torch.testing.assert_close(attention(q, k_cache, v_cache, table, lengths, bs, D ** -0.5), gathered(),
                                   rtol=1e-4, atol=1e-5)
        native = best_us(lambda: attention(q, k_cache, v_cache, table, lengths, bs, D ** -0.5))
        torch_ops = best_us(gathered)
        rows.append((f"decode attention, B={B}, S={S}", f"{torch_ops:.0f}", f"{native:.0f}", f"{torch_ops / native:.1f}x"))
    for N, T in ((256, 1), (512, 1), (768, 1), (8192, 1), (768, 8), (8192, 8)):
        copies = [torch.randn(N, H) for _ in range(max(2, (96 << 20) // (N * H * 4)))]
        x = torch.randn(T, H)
        torch.testing.assert_close(linear(x, copies[0]), F.linear(x, copies[0]), rtol=1e-4, atol=1e-4)
        for kind, calls in (("hot", 100), ("cold", len(copies))):
            which = iter(range(10**9))
            pick = (lambda: copies[0]) if kind == "hot" else (lambda: copies[next(which) % len(copies)])
            native, torch_ops = best_us(lambda: linear(x, pick()), calls), best_us(lambda: F.linear(x, pick()), calls)
            rows.append((f"linear {T} x [{N}, {H}], {kind}", f"{torch_ops:.1f}", f"{native:.1f}",
                         f"{torch_ops / native:.1f}x"))
    if args.bf16:
        for N in (2048, 50304):
            w = (torch.randn(N, 2048) * 0.02).bfloat16()
            for T in (1, 8, 32, 64):
                x = torch.randn(T, 2048).bfloat16()
                torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=2e-2, atol=2e-2)
                native, torch_ops = best_us(lambda: linear(x, w), 5), best_us(lambda: F.linear(x, w), 5)
                gflop = 2 * T * N * 2048 / 1e3
                rows.append((f"bf16 linear {T} x [{N}, 2048] (GFLOP/s {gflop / torch_ops:.0f} vs {gflop / native:.0f})",
                             f"{torch_ops:.0f}", f"{native:.0f}", f"{torch_ops / native:.1f}x"))
    title = (f"native kernels vs torch ops, µs per call, {torch.get_num_threads()} threads"
             + (f"; bf16 in hardware: {kernels.cpu_has_bf16_matmul()}" if args.bf16 else ""))
    print_table(title, ["case", "torch ops", "native", "speedup"], rows)
    if args.out:
        from moetailor.bench.page import Table, write_tables
        write_tables(args.out, [Table(title, ["case", "torch ops µs", "native µs", "speedup"], rows)])


if __name__ == "__main__":
    main()
