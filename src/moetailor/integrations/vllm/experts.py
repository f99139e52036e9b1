"""moetailor's experts kernel in place of vLLM's CPU fused-MoE, so that budgets and pools save work.

Opt in per engine: ``additional_config={"moetailor_experts_kernel": true}`` (``vllm serve
--additional-config '{"moetailor_experts_kernel": true}'``).

Why: the routing hook already sends every dropped route (past a request's ``expert_top_k``, outside
a pool, skipped, folded away) to weight 0 on an expert the token keeps, so vLLM's kernel reads no
expert that no kept route reads. But on a processor without AVX-512 vLLM's bf16 fused-MoE runs its
``vec`` path, whose step time barely follows the experts a step reads (docs/vllm.md: masked 25% ~
masked 50% ~ full k at batch 8), and it still computes every weight-0 route. moetailor's engine
kernel (``torch.ops.moetailor.swiglu_experts``, ``kernels/experts.cpp``) reads each routed expert
once, skips experts without a route, and here also skips every weight-0 route: a token at k=4 costs
four expert rows, not eight.

How: two methods of vLLM's ``CPUUnquantizedExperts`` (the portable, AMX and other ISA subclasses
inherit them) are wrapped, for the layers of an engine that asked:

* ``process_weights_after_loading`` keeps the checkpoint layout (w13 [E, 2I, H] = gate then up,
  w2 [E, H, I], contiguous) instead of padding and prepacking it for vLLM's kernel, or, where the
  kernel has its AVX-512 panel tile (``kernels.packed_weights_pay``), packs it into that tile's
  16-column panels as moetailor's engine holds its experts (``kernels.pack_weight``);
* ``moe_problem_size`` reads the sizes from the layer's config when the weights are packed (vLLM's
  default unpacks them from 3-D weights, as vLLM's own CPU int4/int8 experts also avoid);
* ``apply`` calls ``swiglu_experts`` on those weights (hidden states in fp32, one rounding back to
  the layer's dtype) and writes vLLM's output buffer.

A layer the kernel cannot run (an activation other than SiLU, expert biases, a width that is not a
multiple of 16, a weight dtype other than fp32/bf16, no compiler for the kernels) stops the start
with a line naming the layer and the reason. Engines that did not ask keep vLLM's kernel.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ...kernels import is_packed

KEY = "moetailor_experts_kernel"          # additional_config key
_loading: list[bool] = []                 # set while a runner that asked loads its model (one process may hold several)


def wanted(additional_config) -> bool:
    """Whether an engine's additional_config asks for moetailor's experts kernel."""
    if not isinstance(additional_config, dict) or KEY not in additional_config:
        return False
    value = additional_config[KEY]
    if not isinstance(value, bool):
        raise ValueError(f"additional_config {KEY} must be true or false, got {value!r}")
    return value


@contextlib.contextmanager
def loading(additional_config):
    """Around a model runner's ``load_model``: its MoE layers take moetailor's kernel if it asked."""
    ask = wanted(additional_config)
    if ask:
        _check_kernels()
    _loading.append(ask)
    try:
        yield
    finally:
        _loading.pop()


def _check_kernels() -> None:
    from ...kernels import swiglu_experts

    if swiglu_experts() is None:
        raise RuntimeError(f"additional_config {KEY}: moetailor's native kernels did not build in this environment "
                           "(they need g++ and ninja: `pip install ninja`); drop the key to use vLLM's kernel")


def _unsupported(experts, layer) -> str | None:
    """Why this layer cannot run on moetailor's kernel, or None."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    cfg = experts.moe_config
    if cfg.activation != MoEActivation.SILU:
        return f"activation {cfg.activation.value} (the kernel is SwiGLU: silu(gate) * up)"
    if getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
        return "expert biases"
    w13, w2 = layer.w13_weight, layer.w2_weight
    if w13.dtype not in (torch.float32, torch.bfloat16) or w2.dtype != w13.dtype:
        return f"expert weights in {w13.dtype} (the kernel takes float32 or bfloat16)"
    E, two_i, hidden = w13.shape
    if two_i % 32 or hidden % 16 or tuple(w2.shape) != (E, hidden, two_i // 2):
        return f"expert shapes w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} (hidden and expert widths must be " \
               "multiples of 16)"
    return None


def install_patches() -> None:
    """Wrap ``CPUUnquantizedExperts`` (idempotent; a build without it has no CPU fused-MoE to replace)."""
    from .names import CPU_EXPERTS, wrap_method

    for method, wrapper in (("process_weights_after_loading", _wrap_process), ("apply", _wrap_apply),
                            ("moe_problem_size", _wrap_problem_size)):
        wrap_method(CPU_EXPERTS, f"CPUUnquantizedExperts.{method}", wrapper)


def _wrap_process(process):
    @functools.wraps(process)
    def wrapped(self, layer):
        if not (_loading and _loading[-1]):
            return process(self, layer)
        why = _unsupported(self, layer)
        if why is not None:
            name = getattr(layer, "layer_name", type(layer).__name__)
            raise ValueError(f"additional_config {KEY}: MoE layer {name} cannot run on moetailor's experts kernel: "
                             f"{why}; drop the key to use vLLM's kernel")
        from vllm.model_executor.utils import replace_parameter

        from ...kernels import pack_weight, packed_weights_pay

        hold = pack_weight if packed_weights_pay() else torch.Tensor.contiguous
        replace_parameter(layer, "w13_weight", hold(layer.w13_weight.data))
        replace_parameter(layer, "w2_weight", hold(layer.w2_weight.data))
        self._moetailor_kernel = True
        self._use_zentorch = False
    return wrapped


def _wrap_apply(apply):
    @functools.wraps(apply)
    def wrapped(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                expert_map, *args, **kwargs):
        if not getattr(self, "_moetailor_kernel", False):
            return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                         global_num_experts, expert_map, *args, **kwargs)
        on_input = kwargs.get("apply_router_weight_on_input", args[-1] if args else False)
        return run_experts(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, bool(on_input),
                           getattr(self, "_moetailor_observe", None))
    return wrapped


def _wrap_problem_size(problem_size):
    @functools.wraps(problem_size)
    def wrapped(self, a1, w1, w2, topk_ids):
        if not getattr(self, "_moetailor_kernel", False) or not is_packed(w1):
            return problem_size(self, a1, w1, w2, topk_ids)
        cfg = self.moe_config                         # packed weights: (E, M, N = 2I, K = H, top-k) from the config
        return (w1.shape[0], a1.size(0) if a1.dim() == 2 else a1.size(1),
                cfg.intermediate_size_per_partition * cfg.w13_num_shards, a1.size(-1), topk_ids.size(1))
    return wrapped


def run_experts(output: torch.Tensor, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map, weight_on_input: bool,
                observe=None) -> None:
    """output [T, H] <- sum over each token's routes of weight * expert(hidden), on moetailor's kernel
    (``kernels.swiglu_experts()`` must have loaded it). A route of weight 0 (what the routing hook makes
    of a dropped one) is skipped: id E. ``observe``: the layer's ``LayerSums`` in an observing engine
    (``observe.py``): the expert outputs of the routes its routing op left there also go to the traffic
    statistics from this pass."""
    if expert_map is not None:
        raise ValueError(f"additional_config {KEY} does not support expert parallelism (an expert map); drop the key")
    E = w13.shape[0]
    weights = topk_weights.float()                                                    # [T, K]
    ids = torch.where(weights != 0, topk_ids.long(), E).contiguous()                  # [T, K] dropped -> E
    if weight_on_input:      # vLLM already scaled the hidden states (top-1 models): weight each route 1
        weights = torch.ones_like(weights)
    # the op by name: vLLM's compiled mode traces this (the kernels' loader, which reads /proc/cpuinfo,
    # ran at load, in ``loading``; the op has a fake implementation)
    x = hidden_states.float().contiguous()                                            # [T, H]
    if observe is not None:   # the sums are the layer's buffers, allocated once: inputs of the traced graph
        T = x.shape[0]
        out = torch.ops.moetailor.swiglu_experts_observed(x, w13, w2, ids, weights.contiguous(), observe.routes[:T],
                                                          observe.gates[:T], observe.outputs)
    else:
        out = torch.ops.moetailor.swiglu_experts(x, w13, w2, ids, weights.contiguous(), torch.zeros(1, dtype=torch.long),
                                                 -1)
    output.copy_(out)


def uses_moetailor_kernel(runner) -> bool:
    """Whether a vLLM MoE runner's experts run on moetailor's kernel."""
    method = getattr(getattr(runner, "routed_experts", None), "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    return bool(getattr(experts, "_moetailor_kernel", False))
