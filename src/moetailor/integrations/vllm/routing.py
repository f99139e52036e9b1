"""The plugin's vLLM side: per-token phase and budget, and the router hooks that read them.

Every step, before vLLM builds its inputs, ``StepTokens.prepare`` writes for each scheduled token
whether it is a decode token (position >= its request's prompt length; vLLM's CPU backend neither
orders decode tokens first nor sets ``num_decode_tokens``, and "query length 1" misreads 1-token
prefill chunks) and its request's ``expert_top_k``. Each MoE layer's runner then

  * adds the phase's router bias (0 kept / -inf dropped) to the router logits before routing
    (works for every runner, modular or monolithic, and for models that pass the gate into the
    fused-MoE layer, like Qwen3-MoE), and
  * trims each token's routes to its budget after routing (zero weight past rank k, renormalised
    when the model renormalises): outputs equal moetailor's, but the experts past k still run.

Buffers are allocated once (``max_num_tokens``) and written in place, so a captured graph reads
the current step's values.
"""
from __future__ import annotations

import numpy as np
import torch

from .plan import EXPERT_TOP_K, RouterTables


class StepTokens:
    """Per-token facts of the current step, in persistent buffers."""

    def __init__(self, max_tokens: int, model_k: int, device):
        self.decode = torch.zeros(max_tokens, dtype=torch.bool, device=device)   # [N]
        self.k = torch.full((max_tokens,), model_k, dtype=torch.long, device=device)  # [N]
        self.model_k = model_k
        self.any_budget = False  # some request in this step asked for fewer experts

    def prepare(self, runner, num_scheduled_tokens: np.ndarray) -> None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        counts = np.asarray(num_scheduled_tokens[:num_reqs])
        req = np.repeat(np.arange(num_reqs), counts)                                  # [T]
        starts = np.cumsum(counts) - counts
        query_pos = np.arange(len(req)) - np.repeat(starts, counts)                   # [T]
        positions = batch.num_computed_tokens_cpu[req] + query_pos                    # [T]
        decode = positions >= batch.num_prompt_tokens[req]                             # [T]
        ks = np.array([request_top_k(runner.requests[rid].sampling_params, self.model_k)
                       for rid in batch.req_ids[:num_reqs]], dtype=np.int64)          # [R]
        T = len(req)
        self.decode.fill_(False)
        self.decode[:T].copy_(torch.from_numpy(decode))
        self.k.fill_(self.model_k)
        self.k[:T].copy_(torch.from_numpy(ks[req]))
        self.any_budget = bool((ks < self.model_k).any())


def request_top_k(sampling_params, model_k: int) -> int:
    extra = getattr(sampling_params, "extra_args", None) or {}
    k = extra.get(EXPERT_TOP_K)
    return model_k if k is None else int(k)


def moe_runners(model: torch.nn.Module) -> list:
    """vLLM's fused-MoE layer objects (the runner FusedMoEFactory returns), one per MoE layer."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def install(model: torch.nn.Module, tables: RouterTables | None, tokens: StepTokens) -> int:
    """Wrap each MoE layer's routing; returns the number of layers hooked."""
    runners = moe_runners(model)
    for runner in runners:
        layer = runner.layer_id
        bias = tables.bias.get(layer) if tables else None
        if bias is not None and not torch.isinf(bias).any():
            bias = None
        phase_k = tables.top_k.get(layer, (tokens.model_k,) * 2) if tables else (tokens.model_k,) * 2
        if min(phase_k) < tokens.model_k and runner.routed_experts.quant_method.is_monolithic:
            raise ValueError(f"this vLLM build routes layer {layer} inside a monolithic fused-MoE kernel, so the "
                             f"plan's top_k cannot be applied there; use a plan without top_k")
        _hook(runner, None if bias is None else bias.to(tokens.decode.device), phase_k, tokens)
    return len(runners)


def _hook(runner, bias: torch.Tensor | None, phase_k: tuple[int, int], tokens: StepTokens) -> None:
    apply_quant, select = runner._apply_quant_method, runner.router.select_experts
    renormalise = bool(getattr(runner.router, "renormalize", True))
    phase_k_t = torch.tensor(phase_k, dtype=torch.long, device=tokens.k.device)       # [2]
    trims_phase = min(phase_k) < tokens.model_k

    def apply_with_bias(hidden_states, router_logits, *args, **kwargs):
        T = router_logits.shape[0]
        phase = tokens.decode[:T].long()                                              # [T]
        router_logits = router_logits + bias.to(router_logits.dtype)[phase]           # [T, E]
        return apply_quant(hidden_states, router_logits, *args, **kwargs)

    def select_with_budget(hidden_states, router_logits, *args, **kwargs):
        weights, ids = select(hidden_states, router_logits, *args, **kwargs)          # [T, K]
        if not (tokens.any_budget or trims_phase):
            return weights, ids
        T = weights.shape[0]
        k = torch.minimum(tokens.k[:T], phase_k_t[tokens.decode[:T].long()])          # [T]
        rank = weights.argsort(dim=-1, descending=True).argsort(dim=-1)               # [T, K]
        kept = weights.masked_fill(rank >= k[:, None], 0.0)
        if renormalise:
            kept = kept / kept.sum(dim=-1, keepdim=True)
        return kept.to(weights.dtype).contiguous(), ids

    if bias is not None:
        runner._apply_quant_method = apply_with_bias
    runner.router.select_experts = select_with_budget
