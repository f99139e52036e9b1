import time, torch
torch.set_num_threads(2)
from moetailor import kernels
exp = kernels.swiglu_experts()
E, H, I, K = 64, 2048, 1024, 8
torch.manual_seed(0)
gu, dn = torch.randn(E, 2*I, H)*.02, torch.randn(E, H, I)*.02
read = torch.full((1,), -1)
for T, pool in ((8, 64), (32, 64), (32, 32), (64, 32)):
    x = torch.randn(T, H); idx = torch.stack([torch.randperm(pool)[:K] for _ in range(T)]); wt = torch.rand(T, K)
    exp(x, gu, dn, idx, wt, read, 0)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); exp(x, gu, dn, idx, wt, read, 0); ts.append(time.perf_counter() - t)
    dt = min(ts); n = int(read[0])
    print(f"T={T} pool={pool}: {dt*1e3:6.1f} ms, distinct {n}, {n*3*H*I*4/dt/1e9:5.1f} GB/s, {T*K*3*H*I*2/dt/1e9:5.1f} GFLOP/s")
