"""The machine's memory read bandwidth, measured in the same run as the decode benchmarks.

Two probes: a large reduction (``torch.sum`` over a tensor well above the L3 cache: pure streaming
read, the floor a bandwidth-bound step is compared with), and a fp32 GEMV over expert weights (the
decode kernel's own ceiling: one token through every expert of a layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .measure import best_us


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s of ``torch.sum`` over an fp32 tensor of ``nbytes``."""
    if nbytes < 4:
        raise ValueError(f"nbytes={nbytes} is too small to measure")
    x = torch.ones(nbytes // 4, dtype=torch.float32)                       # [N], touched once so pages exist
    return nbytes / (best_us(lambda: torch.sum(x), calls=1, rounds=repeats, warmup=0) / 1e6)


def gemv_bandwidth(gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None, repeats: int = 3,
                   experts: int = 40, hidden: int = 2048, width: int = 1024) -> float:
    """Best-of-``repeats`` bytes/s of one token through every expert: gate_up [E, 2I, H], down [E, H, I].
    With no tensors given, allocates ``experts`` fp32 experts of the synthetic model's shape (1 GB at 40)."""
    if gate_up is None or down is None:
        gate_up = torch.randn(experts, 2 * width, hidden) * 0.02
        down = torch.randn(experts, hidden, width) * 0.02
    x = torch.randn(1, gate_up.shape[-1], dtype=gate_up.dtype)             # [1, H]
    nbytes = (gate_up.numel() + down.numel()) * gate_up.element_size()

    def every_expert() -> None:
        for e in range(gate_up.shape[0]):
            g, u = F.linear(x, gate_up[e]).chunk(2, dim=-1)                # [1, I]
            F.linear(F.silu(g) * u, down[e])                               # [1, H]

    with torch.inference_mode():
        return nbytes / (best_us(every_expert, calls=1, rounds=repeats, warmup=0) / 1e6)
