"""Which weight format decodes fastest on this CPU: fp32, bf16 or int8 weight-only expert GEMVs.

A decode step streams each routed expert's weights once for a few rows, so the kernel's streaming
rate bounds it. This probe times the experts' matmuls per format over a pool well above the
last-level cache (the synthetic model's shapes): "fp32" and "bf16" ``F.linear`` (oneDNN), "int8"
weights with one fp32 scale per output row (``aten._weight_int8pack_mm``, activations fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .measure import best_us

FORMATS = ("fp32", "bf16", "int8")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: w [N, K] -> (q [N, K] int8, scale [N] fp32), w ~ q * scale."""
    scale = w.abs().amax(dim=-1).float().clamp_min(1e-12) / 127.0                # [N]
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)    # [N, K]
    return q, scale


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ (q * scale).T -> [M, N] fp32."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _experts(fmt: str, experts: int, hidden: int, width: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(experts):
        gu = torch.randn(2 * width, hidden, generator=g) * 0.02                    # [2I, H]
        dn = torch.randn(hidden, width, generator=g) * 0.02                        # [H, I]
        if fmt == "bf16":
            gu, dn = gu.bfloat16(), dn.bfloat16()
        if fmt == "int8":
            gu, dn = quantize_int8(gu), quantize_int8(dn)
        out.append((gu, dn))
    return out


def _expert_forward(fmt: str, x: torch.Tensor, gu, dn) -> torch.Tensor:
    if fmt == "int8":
        g, u = int8_linear(x, *gu).chunk(2, dim=-1)                                # [M, I]
        return int8_linear(F.silu(g) * u, *dn)                                     # [M, H]
    g, u = F.linear(x, gu).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, dn)


def probe(formats=FORMATS, rows=(1, 2, 4, 8), experts: int = 24, hidden: int = 2048, width: int = 1024,
          repeats: int = 3) -> list[dict]:
    """Per format and row count: best-of-``repeats`` seconds per expert and weight GB/s streamed."""
    results = []
    for fmt in formats:
        pool = _experts(fmt, experts, hidden, width)
        per_expert = 3 * hidden * width * {"fp32": 4, "bf16": 2, "int8": 1}[fmt]
        with torch.inference_mode():
            for m in rows:
                x = torch.randn(m, hidden)                                         # [M, H]
                x = x.bfloat16() if fmt == "bf16" else x
                _expert_forward(fmt, x, *pool[0])                                  # warm-up (kernel selection)
                every = lambda pool=pool, x=x: [_expert_forward(fmt, x, gu, dn) for gu, dn in pool]  # noqa: E731
                best = best_us(every, calls=1, rounds=repeats, warmup=0) / 1e6
                results.append({"format": fmt, "rows": m, "ms_per_expert": 1e3 * best / experts,
                                "weight_gb_s": per_expert * experts / best / 1e9})
        del pool
    return results


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from .bandwidth import read_bandwidth
    bw = read_bandwidth()
    print(json.dumps({"read_gb_s": round(bw / 1e9, 1), "threads": torch.get_num_threads()}))
    fp32 = {}
    for r in probe(rows=args.rows, experts=args.experts):
        fp32.setdefault(r["rows"], r["ms_per_expert"]) if r["format"] == "fp32" else None
        r["speed_vs_fp32"] = fp32[r["rows"]] / r["ms_per_expert"]
        r["of_read_bw_fp32_equiv"] = (r["weight_gb_s"] * {"fp32": 1, "bf16": 2, "int8": 4}[r["format"]]) / (bw / 1e9)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)


if __name__ == "__main__":
    main()
