"""The experts op at 1 token on weights in 4 KB pages against the same shapes collapsed to 2 MB pages
(madvise MADV_COLLAPSE), rounds in turn: llama.cpp's GGUF weights are mapped in 2 MB pages here
(FilePmdMapped in its smaps), the engine's in 4 KB ones.

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-05-s22/thp_ab.py
"""
import ctypes, time, torch
from moetailor import kernels
torch.set_num_threads(2)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
MADV_COLLAPSE, MADV_HUGEPAGE = 25, 14
def collapse(t):
    a, n = t.data_ptr(), t.numel() * t.element_size()
    lo = (a + (2 << 20) - 1) & ~((2 << 20) - 1); hi = (a + n) & ~((2 << 20) - 1)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    r = libc.madvise(lo, hi - lo, MADV_COLLAPSE)
    return r, ctypes.get_errno()
def anon_huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"): return line.split()[1]
E, I, H, K = 64, 1024, 2048, 8
def make():
    gu = kernels.pack_weight(torch.randn(E * 2 * I, H).to(torch.bfloat16)).view(E, 2 * I // 16, H // 2, 16, 2).contiguous()
    dn = kernels.pack_weight(torch.randn(E * H, I).to(torch.bfloat16)).view(E, H // 16, I // 2, 16, 2).contiguous()
    return gu, dn
plain = [make() for _ in range(2)]
huge = [make() for _ in range(2)]
print("AnonHugePages before", anon_huge())
for gu, dn in huge:
    print("collapse", collapse(gu), collapse(dn))
print("AnonHugePages after", anon_huge())
exp = kernels.swiglu_experts(); read = torch.zeros(4, dtype=torch.long)
x = torch.randn(1, H)
def t_exp(layers):
    ts = 0.0
    for i in range(16):
        gu, dn = layers[i % 2]
        idx = torch.randperm(E)[:K].view(1, K); w = torch.full((1, K), 1 / K)
        t = time.perf_counter(); exp(x, gu, dn, idx, w, read, 0); ts += time.perf_counter() - t
    return 16 * K * 3 * I * H * 2 / ts / 1e9
for rnd in range(4):
    a, b = (t_exp(plain), t_exp(huge)) if rnd % 2 == 0 else tuple(reversed((t_exp(huge), t_exp(plain))))
    print(f"4K pages {a:.1f} GB/s, 2M pages {b:.1f} GB/s, ratio {b / a:.2f}")
