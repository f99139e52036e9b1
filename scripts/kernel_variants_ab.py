"""Variants of the native kernels timed in turn in one process: the experts op at OLMoE-1B-7B's shapes.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/kernel_variants_ab.py \
        base@/tmp/old-kernels= new= new-flag=-DSOME_MACRO --tokens 64 32 --pool 32 --rounds 6

Each variant is NAME[@DIR]=FLAGS: the kernel sources in DIR (default: this tree's
``src/moetailor/kernels``; e.g. ``git worktree add /tmp/old <commit>`` then ``@/tmp/old/src/moetailor/kernels``)
compiled with extra compiler FLAGS (comma-separated; e.g. the switches of the patches in
``docs/bench/2026-12-04-s19/``), each under its own op namespace (``mt_NAME``) so
that all load into one process. Why one process: separate processes one after the other on this
2-core machine drift by more than the differences being measured. Every variant's output is checked
against the first's; rounds alternate the order. Per T: best and median ms per layer, and the floor
(the distinct experts' bytes at the read yardstick, ``bench.bandwidth.read_bandwidth``).
"""
from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from experts_kernel_flops import routes   # scripts/, next to this file
from moetailor import kernels
from moetailor.bench.bandwidth import read_bandwidth

SOURCES = ("experts.cpp", "attention.cpp", "norm.cpp", "rotary.cpp", "decode_layer.cpp", "bindings.cpp")


def load_variant(name: str, source_dir: Path, flags: list[str]):
    """The experts op of the sources in `source_dir`, built with `flags` under namespace mt_<name>."""
    build = Path(f"/tmp/moetailor-kernel-variants/{name}")
    build.mkdir(parents=True, exist_ok=True)
    for f in [*source_dir.glob("*.cpp"), *source_dir.glob("*.h")]:
        text = f.read_text().replace("TORCH_LIBRARY(moetailor,", f"TORCH_LIBRARY(mt_{name},")
        (build / f.name).write_text(text.replace("TORCH_LIBRARY_IMPL(moetailor,", f"TORCH_LIBRARY_IMPL(mt_{name},"))
    digest = hashlib.sha256(" ".join(flags).encode() + str(source_dir).encode()).hexdigest()[:8]
    cpp_extension.load(name=f"mt_{name}_{digest}", sources=[str(build / s) for s in SOURCES],
                       extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    return getattr(torch.ops, f"mt_{name}").swiglu_experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", help="NAME[@DIR]=FLAGS")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64])
    ap.add_argument("--pool", type=int, default=32, help="route uniformly over the first P experts (0: all 64, skewed)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rtol", type=float, default=1e-4, help="outputs checked against the first variant's (bf16 rows: ~1e-2)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    default_dir = Path(kernels.__file__).parent
    ops = {}
    for spec in args.variants:
        head, _, flags = spec.partition("=")
        name, _, where = head.partition("@")
        ops[name] = load_variant(name, Path(where) if where else default_dir, [f for f in flags.split(",") if f])

    E, H, I, K = 64, 2048, 1024, 8
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    layers = [tuple(kernels.pack_weight((torch.randn(*shape, generator=g) * 0.02).to(dtype))
                    for shape in ((E, 2 * I, H), (E, H, I))) for _ in range(args.layers)]
    read = torch.zeros(args.layers, dtype=torch.int64)
    for T in args.tokens:
        x = torch.randn(T, H, generator=g)
        index, weight = routes(T, E, K, args.pool, g)
        first = None
        for op in ops.values():                                              # same answer from every variant
            out = op(x, *layers[0], index, weight, read, 0)
            first = out if first is None else torch.testing.assert_close(out, first, rtol=args.rtol, atol=args.rtol) or first
        times = {name: [] for name in ops}
        for r in range(args.rounds):
            for name in (list(ops) if r % 2 == 0 else list(reversed(ops))):
                t0 = time.perf_counter()
                for layer, (gate_up, down) in enumerate(layers):
                    ops[name](x, gate_up, down, index, weight, read, layer)
                times[name].append((time.perf_counter() - t0) / args.layers * 1e3)
        yardstick = read_bandwidth() / 1e9
        floor_ms = int(read[0]) * 3 * H * I * dtype.itemsize / yardstick / 1e6
        for name, ts in times.items():
            print(f"{args.dtype} T={T} pool={args.pool} {name:10s}: best {min(ts):6.2f} median {sorted(ts)[len(ts) // 2]:6.2f} "
                  f"ms/layer; floor {floor_ms:5.2f} ms (yardstick {yardstick:.1f} GB/s): {100 * floor_ms / min(ts):3.0f}%",
                  flush=True)


if __name__ == "__main__":
    main()
