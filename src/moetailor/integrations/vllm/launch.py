"""Engine arguments for vLLM with a moetailor plan, checked before vLLM starts.

``engine_kwargs`` gives the keyword arguments of ``vllm.LLM`` / ``EngineArgs`` (the same names as
``vllm serve`` flags): the plan goes in ``additional_config``, prefix caching is turned off when
the plan's phases differ, and on the CPU backend the KV cache gets an explicit size instead of a
share of host memory. vLLM's default compilation stays on (``enforce_eager=False``): the plugin's
hooks are graph-safe.
"""
from __future__ import annotations

from pathlib import Path

from ...models.loading import resolve_model_path
from .plan import DECODE_PLAN_KEY, NOVICE_KEY, PLAN_KEY, load_checked_plan


def engine_kwargs(model: str | Path, plan: str | Path | None = None, decode_plan: str | Path | None = None, *,
                  dtype: str = "float32", kv_cache_mib: int | None = 512, enforce_eager: bool = False,
                  experts_kernel: bool = False, observe: str | Path | None = None, observe_every: int = 0,
                  novice: bool = False, **overrides) -> dict:
    """vLLM engine keyword arguments serving ``model`` ('reference' or a checkpoint directory);
    ``experts_kernel``: MoE layers on moetailor's experts kernel (``experts.py``) instead of vLLM's;
    ``observe``: write the served traffic's calibration statistics there (``observe.py``), also every
    ``observe_every`` steps; ``novice``: every MoE layer adds novice constants, so that plans switched
    in later may replace experts by them (a novice start plan needs no flag)."""
    if plan and decode_plan:
        raise ValueError("give --plan or --decode-plan, not both")
    path = resolve_model_path(model)
    kwargs = dict(model=str(path), dtype=dtype, enforce_eager=enforce_eager)
    extra = {}     # additional_config
    if kv_cache_mib:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_mib) << 20
    given = plan or decode_plan
    if given:
        checked = load_checked_plan(given, "plan" if plan else "decode", path)  # the one-line error, before vLLM starts
        extra[PLAN_KEY if plan else DECODE_PLAN_KEY] = str(Path(given).resolve())
        if checked.prefill != checked.decode:
            kwargs["enable_prefix_caching"] = False
    if novice:
        extra[NOVICE_KEY] = True
    if experts_kernel:
        from .experts import KEY
        extra[KEY] = True
    if observe is not None or observe_every:
        from .observe import EVERY_KEY, OBSERVE_KEY, check_observe_config

        if observe is None:
            raise ValueError("--observe-every needs --observe STATS (the statistics file to write)")
        extra.update({OBSERVE_KEY: str(Path(observe).absolute()), EVERY_KEY: observe_every})
        check_observe_config(extra)    # the one-line error, before vLLM starts
        import torch
        if torch.cuda.is_available():      # observing under CUDA graphs is untested (observe.py): run eager
            kwargs["enforce_eager"] = True
    if extra:
        kwargs["additional_config"] = extra
    kwargs.update(overrides)
    return kwargs


def cli_flags(kwargs: dict) -> list[str]:
    """The same settings as ``vllm serve`` flags."""
    import json

    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
