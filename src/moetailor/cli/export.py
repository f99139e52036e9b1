"""`moetailor export gguf MODEL_OR_PRUNED --out model.gguf [--outtype f32|bf16|q8_0] [--plan PLAN]`:
a GGUF file for llama.cpp, written by llama.cpp's own converter (`make setup-llamacpp`)."""
from __future__ import annotations

from ..tables import print_table
from .options import add_overwrite_option


def register(sub) -> None:
    p = sub.add_parser("export", help="write a model for another runtime (gguf: llama.cpp)")
    formats = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    g = formats.add_parser("gguf", help="a GGUF file for llama.cpp (llama.cpp's own converter; `make setup-llamacpp`)")
    g.add_argument("model", help="checkpoint directory (a `moetailor prune` output too) or a bundled model ('reference', 'reference-qwen3')")
    g.add_argument("--out", required=True, help="GGUF file to write")
    g.add_argument("--outtype", choices=("f32", "bf16", "q8_0"), default="f32",
                   help="tensor type (default f32: llama.cpp then computes what moetailor's fp32 engine does)")
    g.add_argument("--plan", default=None, help="plan file: export its --phase's kept experts (pruned on the way; the "
                   "plan must keep the same count in every layer) and its top_k")
    g.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="with --plan: which phase's policy to export (default decode)")
    g.add_argument("--expert-top-k", type=int, default=None,
                   help="experts routed per token, written into the file (<arch>.expert_used_count; default the model's k)")
    g.add_argument("--allow-routing-difference", action="store_true",
                   help="export even when llama.cpp's graph for this architecture renormalises the top-k expert "
                   "weights differently from the checkpoint (a different model: for speed comparisons)")
    add_overwrite_option(g)
    g.add_argument("--verbose", action="store_true", help="show the converter's log")
    g.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    from ..transforms.gguf import export_gguf, export_plan_gguf
    from .calibrate import command_line

    common = dict(outtype=args.outtype, top_k=args.expert_top_k, overwrite=args.overwrite,
                  allow_routing_difference=args.allow_routing_difference, verbose=args.verbose)
    if args.plan is not None:
        result = export_plan_gguf(args.model, args.plan, args.out, phase=args.phase,
                                  command=command_line(args, positional=("model",)), **common)
    else:
        result = export_gguf(args.model, args.out, **common)
    rows = [
        ("llama.cpp architecture", result.arch),
        ("experts per layer", result.num_experts),
        ("experts per token", f"{result.top_k} (model k {result.model_top_k})"),
        ("tensor type", result.outtype),
        ("size", f"{result.bytes / 2**20:.1f} MiB"),
        ("output head", "untied (embedding written as output.weight)" if result.untied else "from the checkpoint"),
        ("pre-tokenizer", result.pre_tokenizer or "llama.cpp's own table"),
        ("fewer experts per token", result.override(max(1, result.model_top_k // 2))
         + f"  (e.g. {max(1, result.model_top_k // 2)}; any 1..{result.model_top_k})"),
        ("run", f"llama-cli -m {result.path} (llama-cpp-python: Llama(model_path=...))"),
    ]
    if result.routing_note:
        rows.append(("differs from moetailor", result.routing_note))
    print_table(f"GGUF -> {result.path}", ["property", "value"], rows)
    return 0
