"""`moetailor calibrate MODEL --data SPEC --tokens N --out stats.safetensors`: per-expert statistics."""
from __future__ import annotations

import shlex

from ..tables import print_table



def register(sub) -> None:
    p = sub.add_parser("calibrate", help="one forward pass over calibration text -> per-expert statistics "
                       "(frequency, mass, EAN, REAP, co-selection, NAEE beta; ExFold tables with --fold)")
    p.add_argument("model", help="local checkpoint directory or 'reference' (the bundled model)")
    p.add_argument("--data", default="mix", help="tasks | text | text:DOMAIN[,DOMAIN] | mix | FILE.jsonl | FILE.txt "
                   "(default: mix)")
    p.add_argument("--tokens", type=int, default=200_000, help="calibration tokens (default 200000)")
    p.add_argument("--out", required=True, help="statistics file to write (.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per forward batch (bounds memory)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence window")
    p.add_argument("--gate", choices=("renorm", "softmax"), default="renorm",
                   help="gate weight g: router scores renormalised over the chosen k (default) or not")
    p.add_argument("--fold", action="store_true", help="also collect ExFold tables (pairs co-selected by a token)")
    p.add_argument("--all-experts", action="store_true",
                   help="compute every expert on every token (implies --fold; folding then sees every pair)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..calibration import calibrate
    from ..calibration.data import data_file
    from ..models import load_model, load_tokenizer, resolve_model_path
    from ..outputs import check_output

    check_output(args.out, overwrite=args.overwrite, inputs=(resolve_model_path(args.model), data_file(args.data)))
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    command = command_line(args, positional=("model",))
    stats = calibrate(model, tokenizer, args.data, args.tokens, seed=args.seed, batch_tokens=args.batch_tokens,
                      seq_len=args.seq_len, gate=args.gate, all_experts=args.all_experts, fold=args.fold,
                      command=command)
    stats.save(args.out)
    rows = []
    for i, layer in stats.layers.items():
        used = int((layer.frequency > 0).sum())
        beta = layer.beta
        rows.append((i, f"{used}/{layer.num_experts}", int(layer.frequency.max()), int(layer.frequency.min()),
                     f"{float(layer.mean_norm[layer.frequency > 0].mean()):.3f}", "-" if beta is None else f"{beta:.3f}"))
    print_table(f"calibrated {stats.meta['tokens']:,} tokens of {stats.meta['data']} in {stats.meta['seconds']:.1f}s "
                f"-> {args.out}", ["layer", "experts used", "max freq", "min freq", "mean ||E(x)||", "beta"], rows)
    return 0


def command_line(args, positional: tuple[str, ...]) -> str:
    """The invocation, rebuilt from the parsed arguments (recorded in the output's metadata)."""
    parts = ["moetailor", args.command]
    for key, value in vars(args).items():
        if key in ("command", "func", "overwrite") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if key in positional:
            parts.append(shlex.quote(str(value)))
        elif value is True:
            parts.append(flag)
        else:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)
