"""moetailor inside vLLM: a general plugin (entry point group ``vllm.general_plugins``), a KV
connector for a pruned decode instance, and a launcher for the disaggregated pair.

vLLM calls ``register`` in every process it starts. It patches three vLLM methods:

  * the model runners' ``load_model``: after the model loads, read the moetailor plan from
    ``additional_config`` (see ``plan.py``), check it against the checkpoint, and hook each MoE
    layer's routing (``routing.py``);
  * ``GPUModelRunner._prepare_inputs``: record each scheduled token's phase and budget;
  * ``InputProcessor._validate_params``: reject an ``expert_top_k`` outside [1, k] at admission
    (the OpenAI server answers 400).

Other modules: ``nixl.py`` (the pair on vLLM's NixlConnector), ``scheduler.py`` (the k-aware
scheduler class), ``kbench.py`` (``moetailor bench vllm-k``).

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
