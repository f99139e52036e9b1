"""The disaggregated pair on vLLM's own KV connector (``NixlConnector``): the prefill instance on
the full checkpoint, the decode instance on the ``moetailor prune`` checkpoint, KV pulled by the
decode instance from the prefill instance's cache over NIXL (UCX; on CPU through shared memory).

vLLM's disaggregation flow, as its P/D proxy drives it:
  1. the prefill request carries ``kv_transfer_params = {"do_remote_decode": True, ...}`` and
     ``max_tokens=1``; when it finishes, the prefill instance keeps the prompt's blocks (for
     ``kv_lease_duration`` seconds or until the decoder's notification) and returns
     ``kv_transfer_params`` naming them, its engine id and its side-channel host/port;
  2. the decode request carries those params (``do_remote_prefill``); the decode instance pulls the
     blocks before it schedules the request, then frees the prefill instance's copy.
vLLM's proxy sends the decode instance the original prompt P, so the decoder recomputes P's last
position itself (on the pruned model) and samples the first token there. moetailor's phase-aware
schedule takes the first token from the full model, so ``generate_pair`` sends P + [t1] (t1 = the
prefill instance's token): the decoder loads len(P) tokens of KV (``remote_num_tokens``), computes
only t1's position, and every later token, on the pruned model. The same semantics as
``MoetailorConnector`` (connector.py), and outputs equal moetailor's engine with the plan's
``phase_aware()`` policy.

The handshake compares the two instances' model paths and refuses a mismatch;
``enforce_handshake_compat: false`` lets the pruned decoder pass (the attention, and so the KV
layout, is unchanged by pruning; ``disagg.check_pair`` checks the decode checkpoint is a pruning of
the prefill model). NIXL needs the ``nixl`` package: ``make setup-vllm-nixl``.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .disagg import check_pair, run_pair, with_max_tokens
from .launch import engine_kwargs

CONNECTOR = "NixlConnector"
SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"


def nixl_available() -> bool:
    """True when ``nixl._api`` imports (the module vLLM's NixlConnector loads)."""
    if importlib.util.find_spec("nixl") is None:
        return False
    # vLLM sets this before its own first import of nixl (a UCX registration-cache leak); importing
    # nixl here first would keep UCX's default
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def require_nixl() -> None:
    if not nixl_available():
        raise ValueError("the NIXL connector needs the `nixl` package in vLLM's environment: run "
                         "`make setup-vllm-nixl` (or use --kv-connector moetailor, the directory-based connector)")


def kv_transfer_config(role: str, **extra) -> dict:
    """NixlConnector settings of one instance: ``kv_producer`` (prefill) or ``kv_consumer`` (decode;
    vLLM 0.32 deprecates ``kv_both`` for NIXL). The KV buffer is the CPU cache itself."""
    return {"kv_connector": CONNECTOR, "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"enforce_handshake_compat": False, **extra}}


def pair_kwargs(model: str | Path, decode_model: str | Path, **common) -> tuple[dict, dict]:
    """Engine arguments of the prefill (full) and decode (pruned) instances on NixlConnector. Each
    instance needs its own side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT`` in its environment)
    when both run on one host; ``side_channel_env`` gives them."""
    require_nixl()
    check_pair(model, decode_model)
    prefill = engine_kwargs(model, kv_transfer_config=kv_transfer_config("kv_producer"), **common)
    # the decode instance's cache holds decode-phase KV: never serve it to a later prompt
    decode = engine_kwargs(decode_model, kv_transfer_config=kv_transfer_config("kv_consumer"),
                           **{**common, "enable_prefix_caching": False})
    return prefill, decode


def side_channel_env(port: int) -> dict[str, str]:
    return {SIDE_CHANNEL_PORT: str(port)}


PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_params(sampling):
    """The prefill request's sampling params: one token, and ask the instance to keep the KV."""
    return with_max_tokens(sampling, 1, kv_transfer_params=dict(PREFILL_PARAMS))


def generate_pair(prefill_llm, decode_llm, prompt_ids: list[list[int]], sampling) -> list[list[int]]:
    """Token ids each prompt generates: the first from the prefill instance, the rest from the decode
    instance, which pulls the prompt's KV from the prefill instance over NIXL."""
    def decode_params(first):
        if not first.kv_transfer_params:
            raise RuntimeError("the prefill instance returned no kv_transfer_params: is it running NixlConnector?")
        return with_max_tokens(sampling, sampling.max_tokens - 1, kv_transfer_params=dict(first.kv_transfer_params))

    return run_pair(prefill_llm, decode_llm, prompt_ids, sampling, prefill_params(sampling), decode_params)[0]
