"""moetailor inside vLLM: a general plugin (entry point group ``vllm.general_plugins``), a KV
connector for a pruned decode instance, and a launcher for the disaggregated pair.

vLLM calls ``register`` in every process it starts. Every vLLM name the plugin touches is in one
registry (``names.py``), checked against the running vLLM before anything is patched
(``patches.check_vllm``; ``vllm_names.json`` records which names vLLM 0.32.0, 0.33.0 and 0.34.0
have, from their sources). It wraps:

  * each model runner generation's ``load_model`` (``runners.py``: one adapter per generation):
    after the model loads, read the moetailor plan from ``additional_config`` (see ``plan.py``),
    check it against the checkpoint, hook each MoE layer's routing (``routing.py``), and let the
    adapter record each scheduled token's phase and budget every step;
  * ``InputProcessor._validate_params``: reject an ``expert_top_k`` outside [1, k] at admission
    (the OpenAI server answers 400).

Calls into a running engine are functions for ``LLM.collective_rpc`` (``rpc.py``).

With ``additional_config`` ``moetailor_observe`` the engine also writes calibration statistics of the
traffic it serves (``observe.py``; ``Worker.shutdown`` is wrapped to write them at shutdown).

Other modules: ``nixl.py`` (the pair on vLLM's NixlConnector), ``scheduler.py`` (the k-aware
scheduler class). Its benchmarks are ``bench/vllm.py`` and ``bench/vllm_k.py`` (``moetailor bench vllm``, ``vllm-k``).

Nothing here is imported in moetailor's own environment unless vLLM is installed.
"""
from __future__ import annotations

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent; vLLM may call it several times)."""
    global _registered
    if _registered:
        return
    _registered = True
    from .patches import apply_patches

    apply_patches()
