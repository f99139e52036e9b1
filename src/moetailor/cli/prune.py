"""`moetailor prune MODEL PLAN --out DIR`: a stock HF checkpoint holding only the plan's kept experts."""
from __future__ import annotations

from ..tables import print_table
from .calibrate import command_line
from .options import add_overwrite_option


def register(sub) -> None:
    p = sub.add_parser("prune", help="write a stock checkpoint with only the kept experts of a plan")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    p.add_argument("plan", help="plan file from `moetailor plan`")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    add_overwrite_option(p, help="replace --out if it exists")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="which phase's kept experts to write (default decode)")
    p.set_defaults(func=run)


def _size(path) -> int:
    from pathlib import Path
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def run(args) -> int:
    from ..memory import peak_rss_gib
    from ..models import resolve_model_path
    from ..models.loading import read_config
    from ..transforms import read_sidecar
    from ..transforms.streaming import prune_checkpoint_streamed

    command = command_line(args, positional=("model", "plan"))
    source = resolve_model_path(args.model)
    read_config(source)   # a malformed config.json: one line naming the file, before any work
    out = prune_checkpoint_streamed(source, args.plan, args.out, overwrite=args.overwrite, phase=args.phase,
                                    command=command)
    side = read_sidecar(out)
    before, after = _size(source), _size(out)
    print_table(f"pruned checkpoint -> {out}", ["property", "value"], [
        ("experts per layer", f"{side['num_experts_original']} -> {side['num_experts_kept']}"),
        ("weights on disk", f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({after / max(before, 1):.0%})"),
        ("kept ids", f"in {out}/moetailor_pruning.json"),
        ("peak RSS", f"{peak_rss_gib():.2f} GiB (streamed: one tensor at a time)"),
    ])
    return 0
