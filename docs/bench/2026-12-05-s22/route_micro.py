"""A bf16 router's logits + selection, torch's ops (linear, softmax, top-k, renormalise, cast) against the
native ones (rows_linear, softmax_topk), at 1 / 8 / 32 rows over 64 router copies (L3-resident).

    flock /tmp/moetailor-heavy.lock .venv/bin/python docs/bench/2026-12-05-s22/route_micro.py
"""
import time, torch
import torch.nn.functional as F
from moetailor import kernels
torch.set_num_threads(2)
lin, sel = kernels.rows_linear(), kernels.softmax_topk()
for E, H in ((64, 2048), (128, 2048)):
    ws = [torch.randn(E, H).to(torch.bfloat16) for _ in range(64)]   # cold-ish: 64 routers
    for T in (1, 8, 32):
        x = torch.randn(T, H).to(torch.bfloat16)
        def stock(w):
            l = F.linear(x, w); p = torch.softmax(l, dtype=torch.float, dim=-1); v, i = torch.topk(p, 8, dim=-1)
            v /= v.sum(-1, keepdim=True); return v.to(l.dtype), i
        def native(w):
            l = lin(x, w, None); v, i = sel(l.float().contiguous(), 8, True, None); return v.to(l.dtype), i
        res = {}
        for name, f in (("stock", stock), ("native", native)) * 3:
            t = time.perf_counter()
            for w in ws: f(w)
            res[name] = min(res.get(name, float("inf")), (time.perf_counter() - t) / len(ws) * 1e6)
        print(f"E={E} T={T}: stock {res['stock']:.1f} us, native {res['native']:.1f} us a layer")
