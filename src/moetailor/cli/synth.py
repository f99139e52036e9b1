"""`moetailor synth PRESET --out DIR [--layers N]`: a synthetic real-shaped checkpoint (random bf16 weights)."""
from __future__ import annotations

from ..tables import print_table
from .options import add_overwrite_option


def register(sub) -> None:
    from ..transforms.synthetic import DEFAULT_SKEW, PRESETS

    p = sub.add_parser("synth", help="write a synthetic checkpoint with a published MoE config's shapes "
                       "(seeded random bf16 weights, sharded safetensors, bundled tokenizer)")
    p.add_argument("preset", choices=list(PRESETS), metavar="PRESET", help="one of: " + ", ".join(PRESETS))
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the published depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=DEFAULT_SKEW,
                   help=f"router skew: how strongly a few experts per layer are hot (default {DEFAULT_SKEW}; 0 = none)")
    p.add_argument("--shard-gib", type=float, default=1.0, help="shard size in GiB (bounds memory; default 1)")
    add_overwrite_option(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    import math
    import shutil
    import time
    from pathlib import Path

    from ..memory import peak_rss_gib
    from ..transforms.artifacts import refuse_existing
    from ..transforms.synthetic import SIDECAR, hub_tensors, synthetic_config, write_synthetic

    out = Path(args.out)
    out = refuse_existing(out, args.overwrite)
    config = synthetic_config(args.preset, args.layers)
    need = sum(2 * math.prod(s) for _, s in hub_tensors(config))
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
    if need > free * 0.95:
        raise ValueError(f"{args.preset} with {config.num_hidden_layers} layers needs {need / 2**30:.1f} GiB of disk, "
                         f"{free / 2**30:.1f} GiB is free; pass a smaller --layers or free disk space")
    t0 = time.time()
    write_synthetic(args.preset, out, layers=args.layers, seed=args.seed, skew=args.skew,
                    shard_bytes=int(args.shard_gib * 2**30), overwrite=args.overwrite)
    info = json.loads((out / SIDECAR).read_text())
    print_table(f"synthetic {args.preset} -> {out}", ["property", "value"], [
        ("architecture", config.model_type), ("decoder layers", config.num_hidden_layers),
        ("parameters", f"{info['parameters']:,}"), ("weights (bf16)", f"{info['bytes'] / 2**30:.2f} GiB"),
        ("seconds", f"{time.time() - t0:.1f}"), ("peak RSS", f"{peak_rss_gib():.2f} GiB")])
    return 0
