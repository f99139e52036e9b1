"""The plugin's vLLM side: per-token phase and budget, and the router hooks that read them.

Every step, before the forward, the runner generation's adapter (``runners.py``) writes for each scheduled token
whether it is live (not padding), whether it is a decode token (position >= its request's prompt
length; vLLM's CPU backend neither orders decode tokens first nor sets ``num_decode_tokens``, and
"query length 1" misreads 1-token prefill chunks) and its request's ``expert_top_k``, into buffers
allocated once. Each MoE layer's router (``select_experts``) is then replaced by ``step_routes``:

  * the engine's ``route`` (``routing/router.py``) on the router logits, once per phase policy,
    each token taking its phase's routes: every ``LayerPolicy`` applies as in moetailor's engine;
  * routes a budget, a pool or skipping dropped (the engine's sentinel id E) are sent to one of the
    token's own kept experts with weight 0 (``redirect_dropped``): vLLM's kernels take no sentinel
    (the CPU fused-MoE does not bounds-check ids), and an expert no route of the step uses gets no
    token, so the kernel skips it and its weights are not read: budgets and pools save the work;
  * a novice policy's route to a replaced expert is dropped the same way (``router.novice_split``),
    and the layer's fused-MoE output gets g * c_e for it: ``_apply_quant_method`` is wrapped to add
    ``step_constants`` (the same routes again, their [T, E] x [E, H] constant product), so no weight
    of a replaced expert is read and the sum is the engine's.

Graph safety (vLLM's default mode traces the model once on CPU, ``DYNAMO_TRACE_ONCE`` with guards
dropped, and captures CUDA graphs on GPU): the routing runs as one opaque torch op,
``torch.ops.moetailor.step_routes`` (``torch.library.custom_op``, with a fake implementation giving
its output shapes), so Dynamo traces a single node and never specialises anything inside it; the op
itself is tensor operations only, on buffers written in place between steps, with no host read of
a per-step value and no branch on one (capturable in a CUDA graph). Every Python decision in it
(which phases differ, the emitted width) is fixed per layer at load. (The disaggregated pair's
decode instance runs eager for a crash the op did not remove: ``disagg.DECODE_EAGER``.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...models.architectures import RouterSemantics
from ...routing.router import CompiledPolicy, route
from ...runtime.experts import novice_split
from .plan import DECODE_FROM, NOVICE_KEY, RouterTables, request_top_k


class StepTokens:
    """Per-token facts of the current step, in persistent buffers (written in place each step)."""

    def __init__(self, max_tokens: int, model_k: int, device):
        self.live = torch.zeros(max_tokens, dtype=torch.bool, device=device)     # [N] a scheduled token
        self.decode = torch.zeros(max_tokens, dtype=torch.bool, device=device)   # [N]
        self.k = torch.full((max_tokens,), model_k, dtype=torch.long, device=device)  # [N]
        self.model_k = model_k
        self.observer = None        # observe.StepObserver: told of each step before its forward

    def request_k(self, sampling_params) -> int:
        return request_top_k(sampling_params, self.model_k)

    @staticmethod
    def decode_from(sampling_params, prompt_len: int) -> int:
        """Where a request's decode tokens start: its prompt length, or an earlier position it asks for
        (``moetailor_decode_from``)."""
        extra = getattr(sampling_params, "extra_args", None) or {}
        start = extra.get(DECODE_FROM)
        return prompt_len if start is None else min(int(start), prompt_len)

    def write(self, decode: np.ndarray, k: np.ndarray, ids: np.ndarray | None = None) -> None:
        """The step's T tokens: decode flags [T] and budgets [T]; the rest of the buffers is padding.
        ``ids``: their token ids where the runner has them on the host (the observer's traffic hash)."""
        if self.observer is not None:
            self.observer.begin(np.asarray(decode, dtype=bool), ids)
        T = len(decode)
        self.live.fill_(False)
        self.live[:T] = True
        self.decode.fill_(False)
        self.decode[:T].copy_(torch.from_numpy(np.asarray(decode, dtype=bool)))
        self.k.fill_(self.model_k)
        self.k[:T].copy_(torch.from_numpy(np.asarray(k, dtype=np.int64)))


@dataclass
class LayerRouting:
    """What one MoE layer routes with, fixed at load (plain Python decisions live here, not in a step)."""

    semantics: RouterSemantics
    prefill: CompiledPolicy
    decode: CompiledPolicy
    width: int                           # routes per token emitted (the largest k of the two phases)
    correction_bias: torch.Tensor | None = None  # [E] DeepSeek's e_score_correction_bias
    adds_constants: bool = False         # the layer's output gets step_constants (hooked at install)

    @property
    def phases_differ(self) -> bool:
        return self.prefill.policy != self.decode.policy

    @property
    def has_constants(self) -> bool:
        """Some phase replaces dropped experts by their constants (a novice policy)."""
        return self.prefill.constants is not None or self.decode.constants is not None


def _phase_routes(logits, layer: LayerRouting, cp: CompiledPolicy, token_k, counted):
    """(weights [T, W], index [T, W], novice constant [T, H] fp32 or None) of one phase's policy,
    padded with dropped routes to the width; a novice route is a dropped route here."""
    E = layer.semantics.num_experts
    counted = counted if cp.policy.batch_pool is not None else None
    w, i = route(logits, layer.semantics, cp, layer.correction_bias, token_k, graph_safe=True, counted=counted)
    constant, w, i = novice_split(cp, w, i)
    pad = layer.width - i.shape[1]
    if pad:
        w = torch.cat([w, w.new_zeros(w.shape[0], pad)], dim=1)
        i = torch.cat([i, i.new_full((i.shape[0], pad), E)], dim=1)
    return w, i, constant


def _step(logits, layer: LayerRouting, live, decode, token_k):
    """Each token's routes and novice constant under its phase's policy: (w [T, W], i [T, W], c [T, H] or None)."""
    logits = logits.float()
    w, i, c = _phase_routes(logits, layer, layer.prefill, token_k, live & ~decode)     # [T, W]
    if layer.phases_differ:
        wd, id_, cd = _phase_routes(logits, layer, layer.decode, token_k, live & decode)
        w = torch.where(decode[:, None], wd, w)
        i = torch.where(decode[:, None], id_, i)
        if c is not None or cd is not None:
            c = c if c is not None else torch.zeros_like(cd)
            cd = cd if cd is not None else torch.zeros_like(c)
            c = torch.where(decode[:, None], cd, c)                                       # [T, H]
    return w, i, c


def step_routes(logits: torch.Tensor, layer: LayerRouting, live: torch.Tensor, decode: torch.Tensor,
                token_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, W], ids int64 [T, W]) for a step that may mix
    prefill and decode tokens (decode [T] bool) and budgets (token_k [T]); padding (live False)
    counts in no batch pool. No host read, no data-dependent branch."""
    w, i, _ = _step(logits, layer, live, decode, token_k)
    return redirect_dropped(w.float(), i, layer.semantics.num_experts, live)


def step_constants(logits: torch.Tensor, layer: LayerRouting, live: torch.Tensor, decode: torch.Tensor,
                   token_k: torch.Tensor, hidden: int) -> torch.Tensor:
    """What the layer's novice routes add to its output: [T, hidden] float32, sum of g * c_e over each
    token's routes to replaced experts (zeros for a layer or phase that replaces none). The same
    routes as ``step_routes`` (same inputs, same ops), so the two agree on which routes were replaced."""
    _, _, c = _step(logits, layer, live, decode, token_k)
    return c if c is not None else logits.new_zeros(logits.shape[0], hidden, dtype=torch.float32)


# op key -> the hooked layer's routing (set at install, per process). A string, so that no trace
# turns it into a symbolic int.
_ROUTINGS: dict[str, LayerRouting] = {}


@torch.library.custom_op("moetailor::step_routes", mutates_args=())
def step_routes_op(logits: torch.Tensor, live: torch.Tensor, decode: torch.Tensor, token_k: torch.Tensor,
                   key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``step_routes`` of the layer ``key`` names, as one op: (weights float32 [T, W], ids int64 [T, W])."""
    return step_routes(logits, _ROUTINGS[key], live, decode, token_k)


def _routes_fake(logits, live, decode, token_k, key):
    width = _ROUTINGS[key].width
    return (logits.new_empty(logits.shape[0], width, dtype=torch.float32),
            logits.new_empty(logits.shape[0], width, dtype=torch.long))


step_routes_op.register_fake(_routes_fake)


@torch.library.custom_op("moetailor::step_constants", mutates_args=())
def step_constants_op(hidden: torch.Tensor, logits: torch.Tensor, live: torch.Tensor, decode: torch.Tensor,
                      token_k: torch.Tensor, key: str) -> torch.Tensor:
    """``step_constants`` of the layer ``key`` names, as one op: float32 [T, H] (H: ``hidden``'s width)."""
    return step_constants(logits, _ROUTINGS[key], live, decode, token_k, hidden.shape[-1])


@step_constants_op.register_fake
def _(hidden, logits, live, decode, token_k, key):
    return logits.new_empty(logits.shape[0], hidden.shape[-1], dtype=torch.float32)


@torch.library.custom_op("moetailor::step_routes_observed", mutates_args=())
def step_routes_observed_op(logits: torch.Tensor, live: torch.Tensor, decode: torch.Tensor, token_k: torch.Tensor,
                            key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``step_routes_op``, and the step's full-router routes added to the layer's traffic statistics
    (``observe.OBSERVERS``: tensor ops into the layer's device sums, counted for a step the runner
    reported only) before routing."""
    from .observe import OBSERVERS

    OBSERVERS[key].add(logits, live, decode)
    return step_routes(logits, _ROUTINGS[key], live, decode, token_k)


step_routes_observed_op.register_fake(_routes_fake)


def redirect_dropped(weights: torch.Tensor, index: torch.Tensor, E: int,
                     live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sentinel routes (id E) -> weight 0 on the token's first kept expert, or (a token with none
    kept) on the first expert some live token of the step keeps, or expert 0 when no token keeps
    one. No route then names an expert that no kept route reads (beyond that last case)."""
    valid = index < E                                                                 # [T, W]
    own = index.gather(1, valid.int().argmax(dim=1, keepdim=True))                   # [T, 1] first kept (or E)
    step_valid = (valid & live[:, None]) if live is not None else valid
    flat = step_valid.reshape(-1)
    step_first = index.reshape(-1).gather(0, flat.int().argmax().reshape(1))         # [1] first kept of the step
    step_first = torch.where(flat.any(), step_first, torch.zeros_like(step_first))
    own = torch.where(valid.any(dim=1, keepdim=True), own, step_first)
    return torch.where(valid, weights, 0.0), torch.where(valid, index, own)


def moe_runners(model: torch.nn.Module) -> list:
    """vLLM's fused-MoE layer objects (the runner FusedMoEFactory returns), one per MoE layer."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def layer_routing(tables: RouterTables, layer: int, correction_bias=None) -> LayerRouting:
    prefill, decode = tables.policies[layer]
    return LayerRouting(tables.semantics, prefill, decode, tables.width(layer), correction_bias)


def install(model: torch.nn.Module, tables: RouterTables, tokens: StepTokens, recorder=None,
            observed: bool = False, constants: bool = False) -> dict[int, str]:
    """Replace each MoE layer's routing with ``step_routes``; returns each hooked layer's op key
    (a monolithic kernel's layer, which takes a fixed logits bias, has none). ``observed``: the op
    also adds the step's routes to the engine's traffic statistics (``observe.OBSERVERS`` by key).
    A layer whose plan replaces experts by constants, or every layer with ``constants`` (plans switched
    in later may), adds ``step_constants`` to its output."""
    runners = moe_runners(model)
    keys = {}
    for runner in runners:
        layer = runner.layer_id
        if layer not in tables.policies:
            raise ValueError(f"vLLM's MoE layer {layer} is not a MoE layer of the checkpoint's config "
                             f"({sorted(tables.policies)}); this architecture's layer numbering is not supported")
        if runner.routed_experts.quant_method.is_monolithic:
            _hook_monolithic(runner, tables, layer, tokens)
            continue
        bias = getattr(runner.router, "e_score_correction_bias", None)
        routing = layer_routing(tables, layer, bias)
        keys[layer] = _hook(runner, routing, tokens, recorder, observed)
        if constants or routing.has_constants:
            _hook_constants(runner, routing, keys[layer], tokens)
    return keys


def swap_tables(keys: dict[int, str], tables: RouterTables) -> None:
    """Route the hooked layers by ``tables`` from the next step on. The traced graph holds only the
    op and its key, so this holds in the compiled mode too, provided each layer's emitted width
    (its largest top_k) does not grow: a narrower plan's routes are padded to the traced width with
    dropped routes, as per-request budgets are; a wider one is refused, naming the layer. So is a
    plan that replaces experts by constants on a layer whose output was not hooked for them."""
    new = {}
    for layer, key in keys.items():
        old = _ROUTINGS[key]
        routing = layer_routing(tables, layer, old.correction_bias)
        if routing.width > old.width:
            raise ValueError(f"layer {layer} would route {routing.width} experts per token where the running graph "
                             f"was traced for {old.width}: start a new engine for a plan that raises top_k")
        if routing.has_constants and not old.adds_constants:
            raise ValueError(f"the plan replaces layer {layer}'s dropped experts by constants (novice experts), and "
                             f"this engine adds none: start it with a novice plan, or with additional_config "
                             f"{{\"{NOVICE_KEY}\": true}} to switch to novice plans later")
        routing.width = old.width      # a narrower plan pads with dropped routes (weight 0), as budgets do
        routing.adds_constants = old.adds_constants
        new[key] = routing
    _ROUTINGS.update(new)


def _hook(runner, routing: LayerRouting, tokens: StepTokens, recorder, observed: bool = False) -> str:
    layer = runner.layer_id
    key = f"{len(_ROUTINGS)}:layer{layer}"
    _ROUTINGS[key] = routing
    op = torch.ops.moetailor.step_routes_observed if observed else torch.ops.moetailor.step_routes

    def select_experts(hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None):
        T = router_logits.shape[0]
        weights, ids = op(router_logits, tokens.live[:T], tokens.decode[:T], tokens.k[:T], key)
        if recorder is not None:
            recorder.record(layer, ids, tokens.live[:T], tokens.decode[:T])
        # cpu_fused_moe reads contiguous float32 weights and int32 ids
        return weights.contiguous(), ids.to(topk_indices_dtype or torch.int32).contiguous()

    runner.router.select_experts = select_experts
    return key


def _hook_constants(runner, routing: LayerRouting, key: str, tokens: StepTokens) -> None:
    """Add the layer's novice constants (``step_constants``) to its fused-MoE output, inside
    ``_apply_quant_method``: before vLLM's routed scaling and the shared experts' sum, where the
    experts' own outputs are, so a constant is scaled and summed as the expert it replaces would be."""
    routing.adds_constants = True
    apply_quant = runner._apply_quant_method

    def apply_with_constants(hidden_states, router_logits, *args, **kwargs):
        T = router_logits.shape[0]
        shared, fused = apply_quant(hidden_states, router_logits, *args, **kwargs)
        if not isinstance(fused, torch.Tensor):
            raise RuntimeError("moetailor: this fused-MoE backend defers its output, which novice constants cannot "
                               "be added to; serve the novice plan with moetailor's engine")
        constant = torch.ops.moetailor.step_constants(hidden_states, router_logits, tokens.live[:T],
                                                      tokens.decode[:T], tokens.k[:T], key)   # [T, H] fp32
        return shared, fused + constant.to(fused.dtype)

    runner._apply_quant_method = apply_with_constants


def _hook_monolithic(runner, tables: RouterTables, layer: int, tokens: StepTokens) -> None:
    """A fused kernel that routes inside itself: only a logits bias can act (plain masks per phase,
    no budgets); anything else is refused by name at start."""
    bias = tables.mask_bias(layer)
    if bias is None:
        fields = sorted({k for cp in tables.policies[layer] for k in cp.policy.to_json() if k != "keep"})
        raise ValueError(f"this vLLM build routes layer {layer} inside a monolithic fused-MoE kernel, which applies "
                         f"only plain keep (mask) pools; the plan uses {', '.join(fields)} there: serve it with a "
                         f"modular fused-MoE backend (the CPU one is) or moetailor's engine")
    bias = bias.to(tokens.decode.device)
    apply_quant = runner._apply_quant_method

    def apply_with_bias(hidden_states, router_logits, *args, **kwargs):
        T = router_logits.shape[0]
        phase = tokens.decode[:T].long()                                              # [T]
        return apply_quant(hidden_states, router_logits + bias.to(router_logits.dtype)[phase], *args, **kwargs)

    runner._apply_quant_method = apply_with_bias


class RouteRecorder:
    """Opt-in (``additional_config: {"moetailor_record_routes": true}``): per layer, the distinct
    experts the kernel reads summed over decode-only steps, and the number of such steps, in
    device buffers updated in place by the hooks (graph-safe). Read with ``totals``."""

    def __init__(self, layers: list[int], num_experts: int, device):
        self.index = {layer: n for n, layer in enumerate(layers)}
        self.num_experts = num_experts
        self.sums = torch.zeros(len(layers), 2, dtype=torch.float64, device=device)  # [L, (experts, steps)]

    def record(self, layer: int, ids: torch.Tensor, live: torch.Tensor, decode: torch.Tensor) -> None:
        E = self.num_experts
        used = torch.zeros(E + 1, dtype=torch.float64, device=ids.device)
        rows = torch.where(live[:, None], ids.long(), E)                             # [T, W] padding -> E
        used.index_add_(0, rows.reshape(-1), torch.ones(rows.numel(), dtype=torch.float64, device=ids.device))
        decode_step = ((live & ~decode).sum() == 0) & (live.sum() > 0)                # [] no prefill token
        row = torch.stack([(used[:E] > 0).sum().double(), torch.ones((), dtype=torch.float64, device=ids.device)])
        self.sums[self.index[layer]].add_(row * decode_step.double())

    def totals(self) -> dict:
        sums = self.sums.cpu().tolist()
        return {layer: {"experts": s[0], "steps": int(s[1])} for layer, (s) in zip(self.index, sums)}

    def reset(self) -> None:
        self.sums.zero_()
