"""`moetailor info MODEL`: the architecture and expert layout of a checkpoint.
`moetailor info PLAN.json`: what a plan keeps, per phase, and what it was calibrated on.
`moetailor info STATS.safetensors`: what a statistics file was calibrated on and what it holds."""
from __future__ import annotations

from pathlib import Path

from ..tables import print_table


def register(sub) -> None:
    p = sub.add_parser("info", help="print architecture, MoE layers, experts, top-k, gating, parameters "
                       "(or, for a plan file, what it keeps and what it was calibrated on)")
    p.add_argument("model", help="local checkpoint directory, a bundled model ('reference', 'reference-qwen3'), "
                   "a plan .json or a statistics .safetensors file (from `moetailor calibrate`)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..models import describe, load_model, resolve_model_path
    from ..models.checkpoint import stored_dtype
    from ..models.loading import read_config
    from ..models.paths import is_bundled

    if str(args.model).endswith(".json"):
        return run_plan(args.model)
    if not is_bundled(args.model) and Path(args.model).is_file():
        return run_file(args.model)
    # the checkpoint's own dtype: its true bytes per expert, and half the memory of fp32 for bf16 weights
    path = resolve_model_path(args.model)
    read_config(path)   # a broken config.json: one clear line before its dtype is read
    facts = describe(load_model(args.model, dtype=stored_dtype(path)))
    rows = []
    for key, value in facts.items():
        if key.startswith("parameters") or key == "bytes_per_expert":
            value = f"{value:,}"
        elif key == "moe_layers":
            value = f"{len(value)} ({', '.join(map(str, value))})" if len(value) < 12 else f"{len(value)} layers"
        rows.append((key.replace("_", " "), str(value)))
    print_table(f"moetailor info {args.model}", ["property", "value"], rows)
    return 0


def run_plan(path: str) -> int:
    from ..calibration.calibrate import describe_calibration
    from ..plans import Plan
    from ..plans.plan import describe_phase

    plan = Plan.load(path)
    meta, model = plan.meta, plan.model
    calibration = meta.get("calibration") or ({"data": meta["stats_data"], "tokens": meta.get("stats_tokens")}
                                              if meta.get("stats_data") else None)
    rows = [("model", f"{model.get('source') or '?'} ({model.get('model_type')}, {model.get('num_experts')} experts "
                      f"top-{model.get('top_k')}, router hash {model.get('router_hash')})"),
            ("calibrated on", describe_calibration(calibration) if calibration else "not recorded"),
            ("criterion", str(meta.get("criterion", "-"))),
            ("keep ratio", "-" if meta.get("keep_ratio") is None else f"{meta['keep_ratio']:g}")]
    for name in ("prefill", "decode"):
        rows.append((name, describe_phase(plan, name)))
    if plan.needs_fold_tables:
        rows.append(("fold statistics", str(plan.fold_stats or "none named: the plan cannot run")))
    for key in ("command", "created"):
        if meta.get(key):
            rows.append((key, str(meta[key])))
    print_table(printable(f"moetailor info {path} (plan)"), ["property", "value"],
                [(key, printable(value)) for key, value in rows])
    return 0


def run_file(path: str) -> int:
    """A file that is neither a plan nor a checkpoint directory: a statistics file is described; any other
    file is one line saying what ``info`` reads (a checkpoint's weights file names its folder)."""
    from safetensors import safe_open

    from ..calibration.calibrate import calibration_record, describe_calibration
    from ..calibration.stats import STATS_FORMAT, ExpertStats

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception:  # safetensors raises its own error types for foreign files
        header = None
    if header is None or header.get("format") != STATS_FORMAT:
        folder = Path(path).resolve().parent
        hint = (f"; for the checkpoint it belongs to run `moetailor info {folder}`"
                if header is not None and (folder / "config.json").exists() else "")
        what = ("a safetensors file but not a moetailor statistics file" if header is not None
                else "not a safetensors file")
        raise ValueError(f"{path} is {what}: info reads a checkpoint directory (the folder with config.json), "
                         "a bundled model name, a plan .json or a statistics .safetensors file written by "
                         f"`moetailor calibrate`{hint}")
    stats = ExpertStats.load(path)
    meta, model = stats.meta, stats.model
    layers = sorted(stats.layers)
    rows = [("what", "expert statistics from `moetailor calibrate` (input of `moetailor plan`)"),
            ("model", f"{model.get('source') or '?'} ({model.get('model_type')}, {model.get('num_experts')} experts "
                      f"top-{model.get('top_k')}, router hash {model.get('router_hash')})"),
            ("calibrated on", describe_calibration(calibration_record(meta))),
            ("MoE layers", f"{len(layers)} ({', '.join(map(str, layers))})" if len(layers) < 12
             else f"{len(layers)} layers"),
            ("fold tables", "yes (plans may fold: `plan --fold`)" if stats.has_fold
             else "no (calibrate --fold records them)"),
            ("expert output statistics", "yes" if stats.has_outputs else "no (written before they were recorded)")]
    for key in ("gate", "dtype", "seconds", "command"):
        value = meta.get(key)
        if isinstance(value, dict):
            value = value.get("name")
        if value is not None:
            rows.append((key, str(value)))
    rows.append(("next", f"moetailor plan {path} --criterion reap --keep 0.5 --out plan.json"))
    print_table(printable(f"moetailor info {path} (statistics)"), ["property", "value"],
                [(key, printable(value)) for key, value in rows])
    return 0


def printable(text: str) -> str:
    """``text`` with control characters written as escapes: a plan's metadata is anyone's text, and
    printed raw its terminal escape sequences would act on the user's terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))
