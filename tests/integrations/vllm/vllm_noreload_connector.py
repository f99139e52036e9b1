"""A deliberately broken MoetailorConnector for test_vllm_preemption.py: a request that vLLM
resumes after a preemption gets no stored KV, so vLLM recomputes its prompt on the decode
instance's (pruned) model, which is what vLLM's NixlConnector does once its one pull is done.
The engine process imports it by module name (this directory is on sys.path under pytest)."""
from __future__ import annotations

from moetailor.integrations.vllm.connector import MoetailorConnector


class NoReloadConnector(MoetailorConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if request.num_preemptions > 0:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
