"""Native CPU kernels, compiled on first use for the processor at hand.

A decode step is short on rows and long on dispatches, so its experts run in one C++ call
(``experts.cpp``) instead of a library GEMM per expert, and its attention reads the paged KV cache in
place (``attention.cpp``) instead of gathering it into a dense copy per layer. The build is cached per source, torch
version and CPU feature set (the processor can change between machines; a build for one can die with
SIGILL on another), so the first engine on a machine pays ~1 minute once. Without a compiler, or with
``MOETAILOR_NATIVE=0``, the accessors return None and the engine keeps torch's kernels.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from functools import cache
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name(name) for name in ("experts.cpp", "attention.cpp", "bindings.cpp")]
_HEADERS = [Path(__file__).with_name("vec.h")]


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@cache
def _module():
    if os.environ.get("MOETAILOR_NATIVE", "1") == "0":
        return None
    from torch.utils import cpp_extension

    digest = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode())
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    try:
        return cpp_extension.load(name=f"moetailor_kernels_{digest.hexdigest()[:12]}", sources=[str(s) for s in _SOURCES],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                  verbose=False)
    except Exception as err:   # no compiler, no headers: the engine still runs, on torch's kernels
        warnings.warn(f"moetailor's native kernels did not build ({type(err).__name__}: {str(err)[:200]}); "
                      "decode steps use torch's kernels instead (install g++ to get them)", stacklevel=2)
        return None


def swiglu_experts():
    """The compiled ``swiglu_experts(x, gate_up, down, index, weight) -> (out, distinct)``, or None."""
    module = _module()
    return None if module is None else module.swiglu_experts


def paged_decode_attention():
    """The compiled ``paged_decode_attention(q, k_cache, v_cache, block_table, lengths, block_size,
    scale) -> out``, or None."""
    module = _module()
    return None if module is None else module.paged_decode_attention
