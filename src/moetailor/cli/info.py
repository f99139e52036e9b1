"""`moetailor info MODEL`: the architecture and expert layout of a checkpoint."""
from __future__ import annotations

from ..tables import print_table


def register(sub) -> None:
    p = sub.add_parser("info", help="print architecture, MoE layers, experts, top-k, gating, parameters")
    p.add_argument("model", help="local checkpoint directory or 'reference' (the bundled model)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..models import describe, load_model

    facts = describe(load_model(args.model))
    rows = []
    for key, value in facts.items():
        if key.startswith("parameters") or key == "bytes_per_expert":
            value = f"{value:,}"
        elif key == "moe_layers":
            value = f"{len(value)} ({', '.join(map(str, value))})" if len(value) < 12 else f"{len(value)} layers"
        rows.append((key.replace("_", " "), str(value)))
    print_table(f"moetailor info {args.model}", ["property", "value"], rows)
    return 0
