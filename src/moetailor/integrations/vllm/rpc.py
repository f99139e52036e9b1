"""The plugin's calls into a running engine, as plain functions for vLLM's ``LLM.collective_rpc``
(which calls ``fn(worker, *args, **kwargs)`` in every worker): nothing is added to vLLM's worker
classes. ``call(llm, use_plan, path)`` runs one.

vLLM sends a function to its engine process only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the
environment before the engine starts (its own rule for every callable RPC: the function travels
pickled, by module and name); ``call`` says so in one line when it is missing.
"""
from __future__ import annotations

import os

from .plan import load_checked_plan, router_tables

SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def call(llm, fn, *args, **kwargs) -> list:
    """``llm.collective_rpc(fn, args=args, kwargs=kwargs)``: one result per worker."""
    if os.environ.get(SERIALIZATION_ENV) != "1":
        raise RuntimeError(f"moetailor's engine calls ({fn.__name__}) reach vLLM's workers as functions: start the "
                           f"engine with {SERIALIZATION_ENV}=1 in the environment")
    return llm.collective_rpc(fn, args=args, kwargs=kwargs)


def _runner(worker):
    return getattr(worker, "model_runner", worker)


def route_totals(worker, reset: bool = False) -> dict:
    """The route recorder's per-layer totals (needs ``additional_config`` ``moetailor_record_routes``),
    by name, so nothing of moetailor's is pickled back."""
    from .patches import RECORD_KEY

    recorder = getattr(_runner(worker), "_moetailor_recorder", None)
    if recorder is None:
        raise ValueError(f"route recording is off; start vLLM with additional_config {{{RECORD_KEY!r}: true}}")
    totals = recorder.totals()
    if reset:
        recorder.reset()
    return totals


def experts_kernel_layers(worker, packed: bool | None = None) -> int:
    """How many MoE layers run on moetailor's experts kernel (``experts.py``); ``True`` / ``False``:
    only those whose weights it holds packed / row-major."""
    from ...kernels import is_packed
    from .experts import uses_moetailor_kernel
    from .routing import moe_runners

    return sum(uses_moetailor_kernel(r) and (packed is None or is_packed(r.routed_experts.w13_weight) == packed)
               for r in moe_runners(_runner(worker).get_model()))


def use_plan(worker, plan: str | None, mode: str = "decode") -> str:
    """Route the next steps of a running engine by another plan (``mode`` "decode" or "plan"), checked
    as at start, or by the full router (``None``). ``moetailor bench vllm`` times every plan row on one
    engine this way, interleaved, so that the machine's drift between processes is not read as a
    difference between plans. Between requests only: a request in flight would decode part of its
    tokens under each plan."""
    from .routing import swap_tables

    runner = _runner(worker)
    keys = getattr(runner, "_moetailor_keys", None)
    if keys is None:
        raise ValueError("this vLLM engine has no moetailor hooks (its model has no MoE layer moetailor knows)")
    config = runner.vllm_config
    checked = load_checked_plan(plan, mode, config.model_config.model) if plan else None
    if checked is not None and checked.prefill != checked.decode and config.cache_config.enable_prefix_caching:
        raise ValueError(f"plan {plan}: a decode policy that differs from the prefill policy needs prefix caching off")
    swap_tables(keys, router_tables(checked, config.model_config.model, device=runner.device, where=plan or "the plan"))
    return plan or "full router"


def save_observed(worker, path: str | None = None) -> dict | None:
    """Write the statistics the engine observed so far (``additional_config`` ``moetailor_observe``) to
    their file, or to ``path``; returns the metadata written (None on a rank that does not write)."""
    from .observe import OBSERVE_KEY

    runner = _runner(worker)
    observer = getattr(runner, "_moetailor_observer", None)
    if observer is not None:
        return observer.save(path)
    if hasattr(runner, "_moetailor_observer") and runner.vllm_config.additional_config.get(OBSERVE_KEY):
        return None       # another rank writes
    raise ValueError(f"this vLLM engine does not observe its traffic; start it with additional_config "
                     f"{{{OBSERVE_KEY!r}: 'stats.safetensors'}}")
