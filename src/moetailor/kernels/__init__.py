"""Native CPU kernels, compiled on first use for the processor at hand.

A decode step is short on rows and long on dispatches, so its experts run in one C++ call
(``experts.cpp``) instead of a library GEMM per expert, and its attention reads the paged KV cache in
place (``attention.cpp``) instead of gathering it into a dense copy per layer. The build is cached per source, torch
version and CPU feature set (the processor can change between machines; a build for one can die with
SIGILL on another), so the first engine on a machine pays ~1 minute once. Without a compiler, or with
``MOETAILOR_NATIVE=0``, the accessors return None and the engine keeps torch's kernels.

The kernels are torch operators (``bindings.cpp``: ``torch.ops.moetailor.swiglu_experts`` and
``torch.ops.moetailor.paged_decode_attention``, ...) with fake implementations registered here, so
``torch.compile`` traces a step through them as opaque ops and the vLLM plugin can call them.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings
from functools import cache
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name(name) for name in ("experts.cpp", "attention.cpp", "norm.cpp", "rotary.cpp",
                                                    "decode_layer.cpp", "observe.cpp", "bindings.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("vec.h", "ops.h")]


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_name(files: list[Path], prefix: str = sys.prefix) -> str:
    """The name torch caches this build under: one per source contents, torch, processor, environment
    and source folder. torch rebuilds a name whenever its source paths or build files change, so two
    venvs (moetailor's and vLLM's), or two checkouts sharing one venv, that shared a name rebuilt each
    other's build in turn (and a build killed midway left a lock the other waited on)."""
    digest = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode() + prefix.encode())
    digest.update(str(files[0].resolve().parent).encode())
    for source in files:
        digest.update(source.read_bytes())
    return f"moetailor_kernels_{digest.hexdigest()[:12]}"


@cache
def _module():
    if os.environ.get("MOETAILOR_NATIVE", "1") == "0":
        return None
    from torch.utils import cpp_extension

    name = build_name(_SOURCES + _HEADERS)
    _clear_stale_build_lock(cpp_extension, name)
    compiling = not _is_built(cpp_extension, name)
    if compiling:   # a first engine on a new processor is otherwise silent for about a minute
        print("moetailor: compiling the native CPU kernels for this processor (once; about a minute)...",
              file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as err:   # no compiler, no headers: the engine still runs, on torch's kernels
        warnings.warn(f"moetailor's native kernels did not build ({type(err).__name__}: {str(err)[:200]}); "
                      "decode steps use torch's kernels instead (install g++ to get them)", stacklevel=2)
        return None
    if compiling:
        print(f"moetailor: native CPU kernels compiled in {time.perf_counter() - started:.0f} s "
              f"(cached under {cpp_extension._get_build_directory(name, verbose=False)})", file=sys.stderr, flush=True)
    _register_fakes()
    return torch.ops.moetailor


def _is_built(cpp_extension, name: str) -> bool:
    """Whether this processor's build of these sources is already on disk (loading it takes a second)."""
    try:
        return (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except (AttributeError, OSError):
        return False


STALE_LOCK_S = 600   # a build takes ~1 minute on an idle machine, a few on a loaded one


def _clear_stale_build_lock(cpp_extension, name: str) -> None:
    """torch's builder marks a build with a lock file and every later process waits for it to go; a
    build killed midway (Ctrl-C, a killed job) leaves it behind and the next engine waits forever.
    A lock older than any real build is removed."""

    try:
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except (AttributeError, OSError):
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"removing a stale kernel build lock ({lock}, {age / 60:.0f} minutes old)", stacklevel=3)
        lock.unlink(missing_ok=True)


def _register_fakes() -> None:
    """Shapes and dtypes of the ops' outputs without running them (torch.compile, meta tensors)."""
    @torch.library.register_fake("moetailor::swiglu_experts")
    def _(x, gate_up, down, index, weight, experts_read, layer):
        return torch.empty_like(x)                                          # [T, H] fp32

    @torch.library.register_fake("moetailor::swiglu_experts_observed")
    def _(x, gate_up, down, index, weight, observe, gate, sums):
        return torch.empty_like(x)                                          # [T, H] fp32

    @torch.library.register_fake("moetailor::observe_routes")
    def _(logits, weights, index, live, decode, armed, slot, sigmoid, renorm, beta_bins, sums, routes, gates):
        return None

    @torch.library.register_fake("moetailor::rows_linear")
    def _(x, weight, bias=None):
        cols = weight.shape[0] * (16 if weight.dim() == 4 else 1)          # [N, H], or packed [N/16, H/P, 16, P]
        return x.new_empty(x.shape[0], cols)                                # [T, N] x's dtype (fp32 or bf16)

    @torch.library.register_fake("moetailor::softmax_topk")
    def _(logits, k, normalise, allowed=None):
        rows = logits.shape[0]                                              # weights / index [T, k]
        return logits.new_empty(rows, k), logits.new_empty(rows, k, dtype=torch.long)

    @torch.library.register_fake("moetailor::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)                                          # [T, H] x's dtype (fp32 or bf16)

    @torch.library.register_fake("moetailor::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)                     # [T, H] fp32 each

    @torch.library.register_fake("moetailor::rotary_kv_write")
    def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return q.new_empty(q.shape)                                         # [B, nH, D], q's dtype

    @torch.library.register_fake("moetailor::paged_decode_attention")
    def _(q, k_cache, v_cache, block_table, lengths, block_size, scale):
        return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])       # [B, nH, Dv] fp32


def swiglu_experts():
    """The op ``swiglu_experts(x [T, H] fp32, gate_up [E, 2I, H], down [E, H, I], index [T, K] int64,
    weight [T, K] fp32, experts_read [L] int64 (written), layer) -> out [T, H]``, or None: writes the
    number of distinct experts it read into ``experts_read[layer]``. The weights may also be both
    packed (``pack_weight``)."""
    ops = _module()
    return None if ops is None else ops.swiglu_experts


def swiglu_experts_observed():
    """The op ``swiglu_experts_observed(x, gate_up, down, index, weight, observe [T, Ko] int64, gate
    [T, Ko] fp32, sums [E, H + 4] float64 (written)) -> out [T, H]``: ``swiglu_experts``, with each
    observed route's expert output added to a layer's calibration sums (``calibration.observe.LayerSums``)
    from the same pass, or None."""
    ops = _module()
    return None if ops is None else ops.swiglu_experts_observed


def observe_routes():
    """The op ``observe_routes(logits, weights, index, live, decode, armed (written), slot, sigmoid,
    renorm, beta_bins, sums, routes, gates (written))``: one step's router-side calibration sums in one
    call (``observe.cpp``; the torch form and the layout: ``calibration.observe.LayerSums``), or None."""
    ops = _module()
    return None if ops is None else ops.observe_routes


def rows_linear():
    """The op ``rows_linear(x [T, H] fp32, weight [N, H] fp32 or bf16 (or packed: ``pack_weight``),
    bias [N] fp32 = None) -> x @ weight.T + bias [T, N]`` for a few rows (a decode step's linear layers
    and LM head; any rows on packed weights), or None.
    bf16 ``x`` (and bias) with bf16 weights gives bf16: the fp32 result rounded once, as torch's GEMM does."""
    ops = _module()
    return None if ops is None else ops.rows_linear


def softmax_topk():
    """The op ``softmax_topk(logits [T, E] fp32, k, normalise, allowed [E] bool = None) -> (weights
    [T, k], index [T, k])``: softmax (over the allowed experts), top-k and optional renormalisation
    in one call (a decode step's routing under a plan or budgets), or None."""
    ops = _module()
    return None if ops is None else ops.softmax_topk


def rms_norm():
    """The op ``rms_norm(x [T, H] fp32, weight [H] fp32, eps) -> weight * x / sqrt(mean(x^2) + eps)``
    in one call (a decode step's norms), or None. bf16 ``x`` and weight: transformers' bf16 RMSNorm
    (variance in fp32, the normalised row rounded to bf16, times the weight rounded again)."""
    ops = _module()
    return None if ops is None else ops.rms_norm


def add_rms_norm():
    """The op ``add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (x + residual,
    rms_norm(x + residual))`` (fp32, or bf16 throughout): a pre-norm layer's residual add and next
    norm in one call, equal to the add followed by ``rms_norm`` bit for bit, or None."""
    ops = _module()
    return None if ops is None else ops.add_rms_norm


def decode_graph():
    """The native decode step as a torch class (``decode_layer.cpp``: ``DecodeGraph``, the layers' weights
    and KV cache bound once; a whole full-router step in one call, or one bound layer in one to three
    calls: ``attention``, ``moe``, and both with the selection between them, ``layer``), or None."""
    return None if _module() is None else torch.classes.moetailor.DecodeGraph

def rows_linear_pays() -> bool:
    """Whether ``rows_linear`` beats torch's GEMV on this processor: where the kernels have a register
    tile for it, AVX-512 or AVX2 with FMA (with AVX2 alone: 1.35-3.1x torch's GEMV at batch 1 on
    the reference model's projections, ``scripts/native_kernels.py``). Without a register tile it is
    2-3x slower. Fixed per processor, not timed per run, so outputs do not change between runs."""
    flags = _cpu_flags().split()
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


def packed_weights_pay() -> bool:
    """Whether the engine holds its weights packed for the native kernels (``pack_weight``): where they
    are compiled for AVX-512, whose panel tile is the one written for that layout (1.03-1.51x the
    row-major tile on a 2048 x 2048 bf16 linear at 1-64 rows without AVX512-BF16). Elsewhere a packed
    weight still computes, on a plain loop."""
    return "avx512f" in _cpu_flags().split()


def _lanes(weight: torch.Tensor) -> int:
    return 2 if weight.dtype == torch.bfloat16 else 1   # values of one 32-bit lane


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[..., cols, depth] (a linear layer's [N, H], experts' [E, cols, depth]) -> the packed layout the
    native ops also take: [..., cols/16, depth/P, 16, P], P = 1 for fp32 and 2 for bf16, so that one
    64-byte load is 16 columns (output features) at P depths. A permutation of the same values
    (``unpack_weight`` inverts it); cols and depth must be multiples of 16."""
    *lead, cols, depth = weight.shape
    if cols % 16 or depth % 16:
        raise ValueError(f"packing needs weights whose sizes are multiples of 16; got {tuple(weight.shape)}")
    P = _lanes(weight)
    return weight.reshape(*lead, cols // 16, 16, depth // P, P).transpose(-3, -2).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The packed layout back to [..., cols, depth] (a copy)."""
    *lead, panels, pairs, lanes, P = packed.shape
    return packed.transpose(-3, -2).reshape(*lead, panels * lanes, pairs * P)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether a weight is in ``pack_weight``'s layout rather than [..., cols, depth] (whose depth, a
    multiple of 16, is never the packed layout's last size, 1 or 2)."""
    return weight.dim() >= 4 and weight.shape[-2] == 16 and weight.shape[-1] == _lanes(weight)


def experts_round_to_bf16() -> bool:
    """Whether the native kernels multiply packed bf16 weights by rows rounded to bf16 (the processor's
    bf16 dot product, AVX512-BF16; ``experts.cpp``: kDotBf16) instead of widening the weights to fp32.
    Only packed weights take that path (the engine packs on AVX-512); tests use the answer to build
    their reference."""
    ops = _module()
    return bool(ops is not None and ops.experts_round_to_bf16())


def cpu_has_bf16_matmul() -> bool:
    """Whether torch's bf16 GEMM runs on bf16 hardware here (AVX512-BF16 dot products or AMX tiles,
    which oneDNN uses). oneDNN's own answer (``mkldnn._is_mkldnn_bf16_supported``) is yes on any
    AVX-512 core, where it widens bf16 in software: without AVX512-BF16 its bf16 GEMM ran 33-61
    GFLOP/s where the native op ran 118-143 and torch's fp32 GEMM 149 (``scripts/native_kernels.py --bf16``).
    Decides the engine's bf16 layers and the trainer's autocast."""
    flags = _cpu_flags().split()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def paged_decode_attention():
    """The op ``paged_decode_attention(q, k_cache, v_cache, block_table, lengths, block_size,
    scale) -> out``, or None."""
    ops = _module()
    return None if ops is None else ops.paged_decode_attention


def rotary_kv_write():
    """The op ``rotary_kv_write(q [B, nH, D], k [B, nKV, D], v [B, nKV, Dv], cos [B, D], sin [B, D],
    k_cache, v_cache (written), slot_mapping [B]) -> rotated q [B, nH, D]``: rotate_half rotary
    embedding of q and k (fp32, or bf16 rounded where torch's bf16 ops round), equal to transformers'
    bit for bit, with k and v written at their slots, or None."""
    ops = _module()
    return None if ops is None else ops.rotary_kv_write
