"""`moetailor calibrate MODEL --data SPEC --tokens N --out stats.safetensors`: per-expert statistics."""
from __future__ import annotations

import shlex
from pathlib import Path

from ..tables import print_table
from .options import add_device_option, add_dtype_option, add_overwrite_option


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="one forward pass over calibration text -> per-expert statistics "
                       "(frequency, mass, EAN, REAP, co-selection, NAEE beta; ExFold tables with --fold)")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    p.add_argument("--data", default=None,
                   help="the traffic to calibrate on: FILE.jsonl (\"text\", \"prompt\"+\"completion\" or chat "
                   "\"messages\" per line) | FILE.txt | tasks | tasks:TASK[,TASK] | text | text:DOMAIN[,DOMAIN] | mix | "
                   "mixture:tasks=0.7,text=0.3 (default for the bundled models: tasks, its workload; required otherwise)")
    p.add_argument("--tokens", type=int, default=200_000, help="calibration tokens (default 200000)")
    p.add_argument("--out", required=True, help="statistics file to write (.safetensors)")
    add_overwrite_option(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per forward batch (bounds memory)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence window (default 512, or the model's positions if fewer)")
    p.add_argument("--gate", choices=("renorm", "softmax"), default="renorm",
                   help="gate weight g: router scores renormalised over the chosen k (default) or not")
    p.add_argument("--fold", action="store_true", help="also collect ExFold tables (pairs co-selected by a token)")
    p.add_argument("--all-experts", action="store_true",
                   help="compute every expert on every token (implies --fold; folding then sees every pair)")
    add_dtype_option(p, "working dtype for calibration", "auto")
    add_device_option(p)
    p.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                   help="load one decoder layer at a time from the shards onto --device (memory: one layer + "
                        "activations); auto (default): when the model would take over 60%% of the memory available "
                        "on --device")
    p.add_argument("--spill-dir", default=None,
                   help="with streaming: keep the activations of all batches on disk here (default: in memory "
                        "up to 4 GiB, then a temporary directory)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..calibration import calibrate
    from ..calibration.calibrate import calibration_record, describe_calibration
    from ..calibration.data import data_file, default_data_spec, parse_data_spec
    from ..device import Placement
    from ..memory import peak_rss_gib
    from ..models import load_model, load_tokenizer, resolve_model_path
    from ..models.checkpoint import should_stream, working_dtype
    from ..outputs import check_output

    args.data = default_data_spec(args.model, args.data)
    parse_data_spec(args.data)  # bad input fails before the model loads
    path = resolve_model_path(args.model)
    args.seq_len = check_seq_len(args.seq_len, path)
    check_output(args.out, overwrite=args.overwrite, inputs=(path, data_file(args.data)))
    if args.spill_dir is not None and Path(args.spill_dir).exists() and not Path(args.spill_dir).is_dir():
        raise ValueError(f"--spill-dir {args.spill_dir} is a file; it needs a directory (an existing folder, or a new "
                         "path moetailor creates)")
    dtype = working_dtype(args.dtype, path)
    tokenizer = load_tokenizer(args.model)
    command = command_line(args, positional=("model",))
    kw = dict(seed=args.seed, batch_tokens=args.batch_tokens, seq_len=args.seq_len, gate=args.gate,
              all_experts=args.all_experts, fold=args.fold, command=command)
    placement = Placement.of(args.device)
    if should_stream(path, dtype, args.stream, device=placement.device):
        from ..calibration.streaming import calibrate_streamed

        stats = calibrate_streamed(path, tokenizer, args.data, args.tokens, dtype=dtype, spill_dir=args.spill_dir,
                                   placement=placement, **kw)
    else:
        stats = calibrate(load_model(args.model, dtype=dtype, placement=placement), tokenizer, args.data, args.tokens,
                          **kw)
    stats.save(args.out)
    rows = []
    for i, layer in stats.layers.items():
        used = int((layer.frequency > 0).sum())
        rows.append((i, f"{used}/{layer.num_experts}", int(layer.frequency.max()), int(layer.frequency.min()),
                     f"{float(layer.mean_norm[layer.frequency > 0].mean()):.3f}",
                     "-" if layer.beta is None else f"{layer.beta:.3f}"))
    if stats.meta["tokens"] < args.tokens:
        print(f"note: {args.data} held {stats.meta['tokens']:,} tokens, fewer than --tokens {args.tokens:,}; "
              "calibrated on each once (more traffic gives steadier statistics)")
    mode = "layer-streamed" if stats.meta.get("streamed") else "in memory"
    where = f"on {placement.device}: peak {placement.device_peak_bytes() / 2**20:,.1f} MiB placed there"
    print(f"calibrated on: {describe_calibration(calibration_record(stats.meta))}")
    print_table(f"calibrated {stats.meta['tokens']:,} tokens of {stats.meta['data']} in {stats.meta['seconds']:.1f}s "
                f"({stats.meta['tokens'] / max(stats.meta['seconds'], 1e-9):,.0f} tok/s, {mode}, {stats.meta['dtype']}, "
                f"peak RSS {peak_rss_gib():.2f} GiB; {where}) -> {args.out}",
                ["layer", "experts used", "max freq", "min freq", "mean ||E(x)||", "beta"], rows)
    return 0


def check_seq_len(seq_len: int | None, path) -> int:
    """--seq-len within the model's positions (a 4096-token window on a 1,024-position model ran on
    positions it never learned, exit 0), checked before the model loads; unset, 512 or the model's
    positions if fewer."""
    from ..models.loading import read_config

    config = read_config(path)
    limit = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    if seq_len is None:
        return min(512, limit) if isinstance(limit, int) else 512
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (got {seq_len})")
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {limit} positions "
                         f"(max_position_embeddings); give --seq-len {limit} or less")
    return seq_len


APPENDED = ("expert_plan",)   # options given once per value (action="append")


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
        elif isinstance(value, (list, tuple)):   # none given: left out; appended options once per value
            items = [shlex.quote(str(item)) for item in value]
            if key in APPENDED:
                parts += [part for item in items for part in (flag, item)]
            elif items:
                parts += [flag, *items]            # nargs="+" (--decode-pools-by-load A B)
        else:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)
