"""The engine decoders' linear and RMSNorm layers on the native ops.

Why: at batch 1 a decode step is dispatch-bound; a linear layer of a few rows through the library
GEMM pays for packing its weight, and transformers' RMSNorm is six ops. Only the engine's decoders
(``runtime/decoder.py``, ``runtime/deepseek.py``) call these; transformers' modules stay stock.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..models.adapters import MoeLayer
from .step import current

NATIVE_LINEAR_ROWS = 8   # up to this many rows a linear layer runs the native op (a decode step's GEMV); else torch's GEMM
NATIVE_LINEAR_DTYPES = (torch.float32, torch.bfloat16)   # the weights the op reads (activations in fp32)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: in an engine decode step of at most ``NATIVE_LINEAR_ROWS`` rows,
    the native op, which streams the [N, H] weight once (2x faster on the reference model's 256-wide
    projections at batch 1); else torch's. A bf16 layer takes its rows in fp32 and rounds the fp32
    sums to bf16 once, as torch's bf16 GEMM does; where that GEMM has no hardware kernels (no
    AVX512-BF16 or AMX: widened in software, 2-3x slower than the op) every decode step's bf16 layer runs the
    op, whatever its rows."""
    step = current()
    rows = x.numel() // x.shape[-1]
    if step is None or step.linear_kernel is None or x.dtype != weight.dtype or x.dtype not in NATIVE_LINEAR_DTYPES \
            or (rows > NATIVE_LINEAR_ROWS and not (x.dtype == torch.bfloat16 and not bf16_gemm_is_fast())):
        return torch.nn.functional.linear(x, weight, bias)
    if x.dtype == torch.bfloat16:   # the op widens the rows and rounds its fp32 sums (+ bias) to bf16 once, as below
        return step.linear_kernel(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias).view(*x.shape[:-1], -1)
    fused = bias is not None and bias.dtype == torch.float32                           # the op adds an fp32 bias
    y = step.linear_kernel(x.reshape(rows, x.shape[-1]).float().contiguous(), weight,  # [rows, N] fp32
                           bias if fused else None)
    if bias is not None and not fused:
        y = y + bias
    return y.to(x.dtype).view(*x.shape[:-1], -1)                                        # [..., N]


_BF16_GEMM_FAST: list[bool] = []   # asked once (a module global: torch.compile reads it without a graph break)


def bf16_gemm_is_fast() -> bool:
    """Whether torch's bf16 GEMM has bf16 hardware under it (``kernels.cpu_has_bf16_matmul``); without,
    a bf16 layer's rows stay on the native op, 2-3x faster. The runner asks before any step, so a
    compiled decode step only reads the answer."""
    if not _BF16_GEMM_FAST:
        _BF16_GEMM_FAST.append(kernels.cpu_has_bf16_matmul())
    return _BF16_GEMM_FAST[0]


def packed_bf16_linears_pay() -> bool:
    """Whether an engine packs its bf16 linear layers for the native op, which then takes every row of
    them: where torch's bf16 GEMM widens in software (``bf16_gemm_is_fast`` false; the op 2-3x faster),
    or where the op has the bf16 dot product itself (``kernels.experts_round_to_bf16``). There the packed
    op beats oneDNN's AVX512-BF16 GEMM at the rows a decode step has (1.3-4.4x at 1-32 rows) and is level
    at 128 (docs/benchmarks.md, "Linear layers"); only a 512-row LM head is slower, and a prefill takes
    the head on each sequence's last token only."""
    return not bf16_gemm_is_fast() or kernels.experts_round_to_bf16()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel) -> torch.Tensor:
    """transformers' RMSNorm of ``x`` (fp32, or bf16 with fp32 inside): one call of the native
    ``kernel``, or op for op without one."""
    if kernel is None:
        f = x.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def runs_native(weight: torch.Tensor) -> bool:
    """Whether the native linear op takes ``weight``: packed, or a contiguous fp32 / bf16 [N, K] whose
    input size is whole 16-wide vectors."""
    return kernels.is_packed(weight) or (weight.dtype in NATIVE_LINEAR_DTYPES and weight.is_contiguous()
                                         and weight.shape[-1] % 16 == 0)


def engine_weight(weight: torch.Tensor, pack: tuple = ()) -> torch.Tensor:
    """The copy of a dense weight an engine decoder reads: packed for the op's panel tile where its
    dtype is in ``pack`` and its sizes allow (``kernels.pack_weight``), else the weight itself. The
    model's own layer keeps its layout, so transformers' modules still run it."""
    weight = weight.detach()
    if weight.dtype in pack and not kernels.is_packed(weight) and weight.dim() == 2 and weight.is_contiguous() \
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
        return kernels.pack_weight(weight)
    return weight


NATIVE_ROUTER_DTYPES = (torch.float32, torch.bfloat16)   # bf16 logits are selected over as fp32, as stock routers do


def native_router(layer: MoeLayer) -> bool:
    """Whether engine decode steps route this layer natively (logits through the step's linear op,
    selection through ``softmax_topk``): softmax scoring (then top-k, renormalised or not) over a
    plain fp32 or bf16 [E, H] weight with no bias, H in 16-wide vectors. DeepSeek's grouped sigmoid
    routing keeps torch's ops."""
    w = getattr(layer.router, "weight", None)
    return (layer.semantics.scoring == "softmax" and layer.router_bias is None
            and getattr(layer.router, "bias", None) is None and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype in NATIVE_ROUTER_DTYPES and w.is_contiguous() and w.shape[1] % 16 == 0)
