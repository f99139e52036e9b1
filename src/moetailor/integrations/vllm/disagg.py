"""Phase-aware disaggregation on vLLM: a prefill instance on the full checkpoint, a decode
instance on the ``moetailor prune`` checkpoint, ``MoetailorConnector`` between them.

``pair_kwargs`` gives the two engines' arguments; ``generate_pair`` runs prompts through two
offline engines; ``proxy_app`` is the OpenAI front the ``moetailor serve --backend vllm`` command
puts before two ``vllm serve`` processes (``serve.py``).
"""
from __future__ import annotations

from pathlib import Path

from ...models.loading import resolve_model_path
from .launch import engine_kwargs
from .plan import checkpoint_fingerprint

CONNECTOR = "MoetailorConnector"
CONNECTOR_MODULE = "moetailor.integrations.vllm.connector"


def kv_transfer_config(role: str, storage: str | Path) -> dict:
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_connector_extra_config": {"storage_path": str(storage)}}


def check_pair(model: str | Path, decode_model: str | Path) -> None:
    """The decode checkpoint must be a pruning of the prefill model (same attention, same KV)."""
    from ...transforms import read_sidecar

    try:
        side = read_sidecar(decode_model)
    except FileNotFoundError:
        raise FileNotFoundError(f"{decode_model} is not a `moetailor prune` checkpoint (no pruning sidecar); make one "
                                f"with `moetailor prune MODEL PLAN --out DIR`") from None
    full = checkpoint_fingerprint(resolve_model_path(model))
    if side["source_model"].get("router_hash") != full["router_hash"]:
        raise ValueError(f"{decode_model} was pruned from another model (router hash "
                         f"{side['source_model'].get('router_hash')} vs {full['router_hash']}); prune this model")


def pair_core_binding(cpus: list[int] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Environment for the prefill and the decode instance of a served pair: their workers on
    disjoint halves of this process's CPUs (``VLLM_CPU_OMP_THREADS_BIND``), or nothing where the
    caller set a binding. Why: vLLM's automatic binding picks the same cores for every instance it
    starts (one NUMA node's cores, less the ones it reserves; with a KV connector on a small machine
    it reserves none and binds them all), so the two instances' OpenMP threads would spin on the
    same cores whenever both are busy."""
    import os

    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return {}, {}
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}, {}
    half = len(cpus) // 2
    return ({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:half]))},
            {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[half:]))})


# The decode instance runs eager by default. On vLLM 0.32's CPU backend in its traced mode
# (DYNAMO_TRACE_ONCE), a decode instance with the plugin loaded, serving requests whose prompt KV
# the connector loaded, died on 5 of 9 starts (docs/vllm.md): a segfault
# inside oneDNN's matmul (vLLM's onednn_mm), glibc's "corrupted double-linked list", or a tensor
# size mismatch in a later layer — memory corruption. The same loop passed 4 of 4 with the plugin
# off and 7 of 7 eager. The prefill instance, and every colocated instance, keep the default
# compiled mode. Pass decode_eager=False to try the traced mode.
DECODE_EAGER = True


def pair_kwargs(model: str | Path, decode_model: str | Path, storage: str | Path, *,
                decode_eager: bool = DECODE_EAGER, **common) -> tuple[dict, dict]:
    """Engine arguments of the prefill (full, producer) and decode (pruned, consumer) instances."""
    check_pair(model, decode_model)
    prefill = engine_kwargs(model, kv_transfer_config=kv_transfer_config("kv_producer", storage), **common)
    # the decode instance's cache holds decode-phase KV: never serve it to a later prompt
    decode = engine_kwargs(decode_model, kv_transfer_config=kv_transfer_config("kv_consumer", storage),
                           **{**common, "enable_prefix_caching": False,
                              "enforce_eager": decode_eager or common.get("enforce_eager", False)})
    return prefill, decode


def generate_pair(prefill_llm, decode_llm, prompt_ids: list[list[int]], sampling) -> list[list[int]]:
    """Token ids each prompt generates: the first from the prefill instance, the rest from the decode
    instance, which receives the prompt's KV through the connector."""
    return run_pair(prefill_llm, decode_llm, prompt_ids, sampling)[0]


def with_max_tokens(sampling, n: int, **extra_args):
    """A copy of vLLM ``SamplingParams`` generating ``n`` tokens, ``extra_args`` added."""
    params = sampling.clone()
    params.max_tokens = n
    if extra_args:
        params.extra_args = {**(params.extra_args or {}), **extra_args}
    return params


def run_pair(prefill_llm, decode_llm, prompt_ids: list[list[int]], sampling, first_params=None,
             rest_params=None) -> tuple[list[list[int]], list]:
    """``generate_pair``'s token ids, and each prompt's decode-instance ``RequestOutput`` (None where
    the first token ended it): its ``kv_transfer_params`` say how often the connector loaded the
    prompt's KV (``{"moetailor_kv_loads": n}``, more than 1 after a preemption). ``first_params``: the
    prefill request's sampling parameters, ``rest_params(first output)``: the decode request's (by
    default one token, then the rest)."""
    first_params = first_params or with_max_tokens(sampling, 1)
    rest_params = rest_params or (lambda first: with_max_tokens(sampling, sampling.max_tokens - 1))
    firsts = prefill_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], first_params, use_tqdm=False)
    out, pending = [], []
    for ids, first in zip(prompt_ids, firsts):
        token = first.outputs[0].token_ids[0]
        out.append([token])
        if sampling.max_tokens > 1 and first.outputs[0].finish_reason != "stop":
            pending.append((len(out) - 1, ids + [token], rest_params(first)))
    decoded: list = [None] * len(out)
    if pending:
        rest = decode_llm.generate([{"prompt_token_ids": ids} for _, ids, _ in pending], [p for _, _, p in pending],
                                   use_tqdm=False)
        for (i, _, _), r in zip(pending, rest):
            out[i] += list(r.outputs[0].token_ids)
            decoded[i] = r
    return out, decoded
