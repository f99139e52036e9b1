"""Colocated decode on the kept experts only: decode steps of a masked plan call vLLM's CPU fused-MoE
kernel with a compact expert tensor (the decode pool's experts) and remapped expert ids, i.e. the
same call the pruned decode instance of the pair makes. Prefill and mixed steps use the full tensor.

Opt-in, through ``additional_config``::

    {"moetailor_decode_plan": "plan.json", "moetailor_compact_decode": true}

The compact tensor is a view when a layer's decode pool is a prefix of the experts (ids 0..m-1, as
the bench's uniform half-pool plan), else a copy of the kept experts (m/E more expert memory). vLLM
prepacks each expert's weights independently (``prepack_moe_weight``), so slicing or gathering
experts along dim 0 keeps the packed layout. The step's phase is read on the host (is every token
of this call a decode token?), a Python branch: only in eager mode (``enforce_eager``), where vLLM
does not trace the model; under vLLM's compiled mode the start refuses the option.
"""
from __future__ import annotations

import functools

import torch
from vllm.logger import init_logger

log = init_logger("moetailor.vllm.compact")
COMPACT_KEY = "moetailor_compact_decode"


def apply_compaction_patch() -> None:
    """Wrap the model runners' ``load_model`` (already wrapped by ``patches``) to install compaction."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        runners.append(CPUModelRunner)
    except ImportError:
        pass
    for cls in runners:
        if "load_model" in cls.__dict__ and not getattr(cls.__dict__["load_model"], "_moetailor_compact", False):
            inner = cls.__dict__["load_model"]

            @functools.wraps(inner)
            def wrapped(self, *args, _inner=inner, **kwargs):
                result = _inner(self, *args, **kwargs)
                maybe_install(self)
                return result

            wrapped._moetailor_compact = True
            cls.load_model = wrapped


def maybe_install(runner) -> int:
    config = runner.vllm_config
    extra = config.additional_config if isinstance(config.additional_config, dict) else {}
    if not extra.get(COMPACT_KEY):
        return 0
    from vllm.config import CompilationMode

    if config.compilation_config.mode != CompilationMode.NONE:
        raise ValueError(f"{COMPACT_KEY} reads each step's phase on the host and needs eager mode: start vLLM with "
                         f"enforce_eager=True (--enforce-eager), or drop {COMPACT_KEY}")
    tokens = getattr(runner, "_moetailor_tokens", None)
    if tokens is None:
        raise ValueError(f"{COMPACT_KEY} needs a moetailor plan (additional_config moetailor_decode_plan)")
    from .plan import load_checked_plan, plan_settings, router_tables
    from .routing import moe_runners

    path, mode = plan_settings(extra)
    plan = load_checked_plan(path, mode, config.model_config.model)
    tables = router_tables(plan, plan.model["num_experts"], tokens.model_k)
    n = 0
    for moe in moe_runners(runner.get_model()):
        bias = tables.bias.get(moe.layer_id)
        if bias is None or torch.isinf(bias[0]).any() or not torch.isinf(bias[1]).any():
            continue   # only a full prefill pool with a smaller decode pool
        kept = (~torch.isinf(bias[1])).nonzero().flatten()                     # [m]
        experts = moe.routed_experts.quant_method.moe_kernel.fused_experts
        experts.apply = _compact_apply(experts.apply, kept, tables.bias[moe.layer_id].shape[1], tokens)
        n += 1
    log.info("moetailor: decode steps of %d MoE layers run on compact expert tensors", n)
    return n


def _compact_apply(apply, kept: torch.Tensor, num_experts: int, tokens):
    m = int(kept.numel())
    prefix = bool(torch.equal(kept, torch.arange(m)))
    remap = torch.zeros(num_experts, dtype=torch.long)                           # [E] full id -> compact id
    remap[kept] = torch.arange(m)
    cache: dict[str, torch.Tensor] = {}

    def compact(w: torch.Tensor, name: str) -> torch.Tensor:
        cached = cache.get(name)
        if cached is None or (prefix and cached.data_ptr() != w.data_ptr()):
            cached = w[:m] if prefix else w.index_select(0, kept.to(w.device))   # [m, ...]
            cache[name] = cached
        return cached

    def wrapped(*args, **kw):
        # vLLM's modular kernel calls apply with keywords (output, hidden_states, w1, w2, topk_weights,
        # topk_ids, activation, global_num_experts, expert_map, ...)
        hidden, ids = kw.get("hidden_states"), kw.get("topk_ids")
        if args or hidden is None or ids is None or kw.get("expert_map") is not None:
            return apply(*args, **kw)
        T = hidden.shape[0]
        if T and bool(tokens.decode[:T].all()):
            kw = dict(kw, w1=compact(kw["w1"], "w1"), w2=compact(kw["w2"], "w2"), global_num_experts=m,
                      topk_ids=remap.to(ids.device)[ids.long()].to(ids.dtype))                  # [T, K]
        return apply(**kw)

    return wrapped
