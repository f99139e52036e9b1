"""The model's own linear and RMSNorm layers, run by the native ops inside engine decode steps.

Why: at batch 1 a decode step is dispatch-bound; a linear layer of a few rows through the library
GEMM pays for packing its weight, and transformers' RMSNorm is six ops. Each layer's ``__class__`` is
swapped once (like the routers'), so outside an engine decode step it is the stock layer, and the
module path and the engine's decoder (``runtime/decoder.py``) run the same arithmetic, bit for bit.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..models.adapters import MoeLayer
from .step import current

NATIVE_LINEAR_ROWS = 8   # up to this many rows a linear layer runs the native op (a decode step's GEMV); else torch's GEMM
NATIVE_LINEAR_DTYPES = (torch.float32, torch.bfloat16)   # the weights the op reads (activations in fp32)
# transformers' RMSNorms that compute weight * (x * rsqrt(mean(x^2) + eps)) in fp32 (not Gemma's 1 + weight)
PLAIN_RMSNORMS = ("Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "OlmoeRMSNorm", "MixtralRMSNorm", "DeepseekV3RMSNorm",
                  "Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm")


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


class NativeLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.is_packed(self.weight):   # packed by an engine (``pack_linears``): only the op reads it
            rows = x.numel() // x.shape[-1]
            y = torch.ops.moetailor.rows_linear(x.reshape(rows, x.shape[-1]).to(self.weight.dtype).contiguous(),
                                                self.weight, self.bias)   # [rows, N]; loaded: the engine packed it
            return y.to(x.dtype).view(*x.shape[:-1], -1)
        return native_linear(x, self.weight, self.bias)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """In an engine decode step on input of the weight's dtype (fp32, or bf16 in a bf16 model: the op
    rounds as the stock forward does, the normalised row to bf16, then its product with the weight),
    the step's native op; else the stock forward (which also covers a bf16 input to fp32 weights
    under a prefill autocast: it takes the variance in fp32)."""
    step = current()
    if step is None or step.norm_kernel is None or x.dtype != self.weight.dtype:
        return type(self).__mro__[1].forward(self, x)
    return rms_norm(x, self.weight, self.variance_epsilon, step.norm_kernel)


_NORM_CLASSES: dict[type, type] = {}


def install_native_linears(model) -> int:
    """Swap the layout the linear op covers: a plain fp32 or bf16 ``nn.Linear`` with a contiguous
    weight whose input size is whole 16-wide vectors. Returns the number of layers swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is NativeLinear:
            swapped += 1
        elif type(module) is torch.nn.Linear and module.weight.dtype in NATIVE_LINEAR_DTYPES and \
                module.weight.is_contiguous() and module.in_features % 16 == 0:
            module.__class__ = NativeLinear
            swapped += 1
    return swapped


def pack_linears(model, keep: tuple = (), dtypes: tuple = (torch.bfloat16,)) -> int:
    """Pack, in place, the native linear layers whose weights are of ``dtypes`` (bf16 where that pays:
    ``packed_bf16_linears_pay``; fp32 where the engine packs and no engine decoder reads the layers, see
    ``ModelRunner``): the op's panel tile then reads them (``kernels.pack_weight``), in decode steps and
    prefill steps alike (at prefill's rows it is GEMM-shaped). A weight another module also holds (tied
    embeddings) stays as it is, as do the modules in ``keep`` (routers: routing reads their weight).
    Returns the number of layers packed."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[p.data_ptr()] = holders.get(p.data_ptr(), 0) + 1
    packed = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is NativeLinear and all(module is not k for k in keep) and not kernels.is_packed(w) and \
                w.dtype in dtypes and w.is_contiguous() and w.shape[0] % 16 == 0 and holders[w.data_ptr()] == 1:
            module.weight = torch.nn.Parameter(kernels.pack_weight(w.detach()), requires_grad=False)
            packed += 1
    return packed


def install_native_norms(model) -> int:
    """Swap every fp32 or bf16 RMSNorm of a class in ``PLAIN_RMSNORMS``. Returns the number swapped."""
    swapped = 0
    for module in model.modules():
        cls = type(module)
        if cls in _NORM_CLASSES.values():
            swapped += 1
        elif cls.__name__ in PLAIN_RMSNORMS and getattr(module, "weight", None) is not None and \
                module.weight.dtype in NATIVE_LINEAR_DTYPES and hasattr(module, "variance_epsilon"):
            if cls not in _NORM_CLASSES:
                _NORM_CLASSES[cls] = type(f"Native{cls.__name__}", (cls,), {"forward": _norm_forward})
            module.__class__ = _NORM_CLASSES[cls]
            swapped += 1
    return swapped


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
