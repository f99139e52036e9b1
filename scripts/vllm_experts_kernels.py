"""vLLM's CPU fused-MoE against moetailor's experts kernel (the plugin's opt-in
``moetailor_experts_kernel``) on the synthetic model's layer shape (64 experts of 2048x1024, bf16,
top-8), on the routes the plugin hands the kernel: full k, every token at k=4 (routes past 4 sent
to weight 0 on the token's first kept expert, as ``redirect_dropped`` does) and a masked 50% pool
(top-8 inside the first 32 experts). Timed in turn, best of 6 rounds of 5 calls.

    flock /tmp/moetailor-heavy.lock .venv-vllm/bin/python scripts/vllm_experts_kernels.py [THREADS]
"""
import sys
import time
from pathlib import Path

import torch
import vllm._custom_ops  # noqa: F401  registers torch.ops._C

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from moetailor.integrations.vllm.experts import run_experts  # noqa: E402
from moetailor.kernels import swiglu_experts  # noqa: E402

assert swiglu_experts() is not None, "moetailor's native kernels did not build"

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
E, H, I, K = 64, 2048, 1024, 8
torch.manual_seed(0)
w13 = (torch.randn(E, 2 * I, H) * 0.02).bfloat16()
w2 = (torch.randn(E, H, I) * 0.02).bfloat16()
p13, p2 = torch.empty_like(w13), torch.empty_like(w2)
torch.ops._C.prepack_moe_weight(w13, p13, "vec")
torch.ops._C.prepack_moe_weight(w2, p2, "vec")


def routes(B: int, mode: str):
    logits = torch.randn(B, E)
    if mode == "masked 50%":
        logits[:, 32:] = float("-inf")
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    if mode == "k=4":
        w[:, 4:] = 0.0
        ids[:, 4:] = ids[:, :1]
    return w.float().contiguous(), ids.int().contiguous()


def vllm_kernel(out, x, w, ids):
    torch.ops._C.cpu_fused_moe(out, x, p13, p2, None, None, w, ids, False, "silu", "vec")


def moetailor_kernel(out, x, w, ids):
    run_experts(out, x, w13, w2, w, ids, None, False)


kernels = {"vLLM": vllm_kernel, "moetailor": moetailor_kernel}
print(f"threads {torch.get_num_threads()}; ms per layer call (best of 6 rounds of 5)")
for B in (1, 8, 32):
    x = torch.randn(B, H).bfloat16()
    cases = {mode: routes(B, mode) for mode in ("full k", "k=4", "masked 50%")}
    res = {(k, m): [] for k in kernels for m in cases}
    for _ in range(7):
        for (k, m) in res:
            w, ids = cases[m]
            out = torch.empty(B, H, dtype=torch.bfloat16)
            t0 = time.perf_counter()
            for _ in range(5):
                kernels[k](out, x, w, ids)
            res[(k, m)].append((time.perf_counter() - t0) / 5)
    best = {key: min(v[1:]) * 1e3 for key, v in res.items()}
    for m, (w, ids) in cases.items():
        distinct = len(set(ids[w > 0].tolist()))
        print(f"B={B:>2} {m:<10} distinct {distinct:>2}: vLLM {best[('vLLM', m)]:6.2f} ms, moetailor "
              f"{best[('moetailor', m)]:6.2f} ms ({best[('vLLM', m)] / best[('moetailor', m)]:.2f}x); vs full k: "
              f"vLLM {best[('vLLM', 'full k')] / best[('vLLM', m)]:.2f}x, moetailor "
              f"{best[('moetailor', 'full k')] / best[('moetailor', m)]:.2f}x", flush=True)
