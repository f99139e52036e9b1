"""vLLM's CPU fused-MoE kernel on the synthetic model's layer shape (64 experts of 2048x1024, bf16,
top-8): the full prepacked 64-expert tensor with routes into its first 32 experts, against a view of
those 32 experts and a 32-expert copy, same routes, timed in turn (best of 6 rounds of 5 calls).
Does a masked pool over the full tensor cost the kernel more than a pruned checkpoint's? (docs/vllm.md)

    flock /tmp/moetailor-heavy.lock .venv-vllm/bin/python scripts/vllm_fused_moe_kernel.py [THREADS]
"""
import time, torch, sys
import vllm._custom_ops  # noqa: F401  registers torch.ops._C
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
E, H, I, K = 64, 2048, 1024, 8
torch.manual_seed(0)
def packed(e):
    w13 = (torch.randn(e, 2 * I, H) * 0.02).bfloat16(); w2 = (torch.randn(e, H, I) * 0.02).bfloat16()
    o13, o2 = torch.empty_like(w13), torch.empty_like(w2)
    torch.ops._C.prepack_moe_weight(w13, o13, "vec"); torch.ops._C.prepack_moe_weight(w2, o2, "vec")
    return o13, o2
full13, full2 = packed(E)
views = {"full (64)": (full13, full2), "prefix view (32)": (full13[:32], full2[:32]),
         "copy (32)": (full13[:32].clone(), full2[:32].clone())}
for B in (1, 8, 32):
    x = torch.randn(B, H).bfloat16()
    ids = torch.stack([torch.randperm(32)[:K] for _ in range(B)]).int()
    w = torch.softmax(torch.randn(B, K), -1).float()
    res = {n: [] for n in views}
    for rnd in range(7):
        for n, (a, b) in views.items():
            out = torch.empty(B, H, dtype=torch.bfloat16)
            t0 = time.perf_counter()
            for _ in range(5):
                torch.ops._C.cpu_fused_moe(out, x, a, b, None, None, w, ids, False, "silu", "vec")
            res[n].append((time.perf_counter() - t0) / 5)
    distinct = len(set(ids.flatten().tolist()))
    print(f"B={B} distinct={distinct}: " + ", ".join(f"{n} {min(v[1:]) * 1e3:.2f} ms" for n, v in res.items()),
          f"| read floor at 12 GB/s {distinct * 3 * H * I * 2 / 12e9 * 1e3:.2f} ms", flush=True)
