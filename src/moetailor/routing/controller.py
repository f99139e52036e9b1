"""Installs routing control on a model; the forward's step (``runtime.step``) says how to route.

Each stock router gets a forward hook (torch's own seam: no class is swapped, nothing is written
onto transformers' modules) that hands its output to the controller, which reads the routing of the
step being run (``runtime.step.current()``): the engine's model runner sets one per engine step,
``policy(...)`` sets a routing-only one for calibration, evaluation and distillation passes. With no
step, or a step that leaves a layer alone, the stock router's own output stands, so the full model is
reproduced bit for bit; observers (calibration, the guard) see every layer's inputs and routes. The
engine's decoders call ``route_layer`` directly. A model's controller is found through a weak map
(``RoutingController.of``, ``installed``).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn

from ..models.adapters import MoeLayer, moe_layers
from ..models.architectures import arch_spec
from ..runtime import experts as experts_impl
from ..runtime.step import Routing, Step, current, experts_read_buffer, running
from .policy import FULL, PhasePolicy
from .router import CompiledPolicy, FoldTables, route

# observer(layer, hidden [T, H], logits [T, E], weights [T, K], index [T, K])
Observer = Callable[[MoeLayer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_CONTROLLERS: "weakref.WeakKeyDictionary[nn.Module, RoutingController]" = weakref.WeakKeyDictionary()


class RouterHook:
    """A router's forward hook: its routes under the step being run (the stock output without one).
    A deep copy of the model (``copy.deepcopy``) gets a hook that does nothing, so the copy is a stock
    model until a controller is installed on it, never a second route through this one."""

    def __init__(self, controller: "RoutingController | None", layer: MoeLayer | None):
        self.controller, self.layer = controller, layer

    def __call__(self, router: nn.Module, args: tuple, stock: tuple):
        if self.controller is None:
            return None
        return self.controller.route_layer(self.layer, args[0], stock=stock)

    def __deepcopy__(self, memo) -> "RouterHook":
        return RouterHook(None, None)


# Rows up to which a bf16 router's logits run the step's linear op, above them torch's GEMM: with
# AVX512-BF16 (OLMoE's 64 x 2048 router, logits + selection) 38 / 72 us against 84 / 106 for torch's
# ops at 1 / 8 rows, 185 against 114 at 32 (the op reads a bf16 row-major weight by rows).
BF16_ROUTER_OP_ROWS = 8


class RoutingController:
    """One per model. ``use(policy)`` sets the phase policy; ``observe`` adds observers."""

    def __init__(self, model: nn.Module, fold_tables: dict[int, FoldTables] | None = None):
        if model in _CONTROLLERS:
            raise RuntimeError("this model already has a RoutingController; reuse RoutingController.of(model)")
        self.model = model
        self.spec = arch_spec(model.config)
        self.layers = moe_layers(model)
        self.fold_tables = fold_tables or {}
        self.fold_source: str | None = None   # where fold_tables came from (a statistics file)
        self.constants: dict[int, torch.Tensor] = {}   # MoE layer -> [E, H] novice constants (pool_mode "novice")
        self.constants_source: str | None = None       # where they came from (a statistics file, a checkpoint)
        self.observers: list[Observer] = []
        self.native_routers: frozenset[int] = frozenset()   # layers an engine's decode steps route natively (runner)
        self._cache: dict[int, tuple[PhasePolicy, dict[int, CompiledPolicy]]] = {}
        self._full: dict[int, CompiledPolicy] = {}   # layer -> the full router compiled (per-token budgets only)
        experts_impl.register()
        for layer in self.layers:
            experts_impl.INSTALLED[layer.experts] = experts_impl.Installed(layer.index)
        self.hooks = [layer.router.register_forward_hook(RouterHook(self, layer)) for layer in self.layers]
        self._previous_impl = getattr(model.config, "_experts_implementation", None)
        model.set_experts_implementation(experts_impl.IMPLEMENTATION)
        _CONTROLLERS[model] = self

    @classmethod
    def of(cls, model: nn.Module) -> "RoutingController":
        """The model's controller, installing one if needed."""
        return _CONTROLLERS.get(model) or cls(model)

    @staticmethod
    def installed(model: nn.Module) -> "RoutingController | None":
        """The model's controller, if one is installed."""
        return _CONTROLLERS.get(model)

    def compile(self, policy: PhasePolicy | None) -> dict[int, CompiledPolicy]:
        """The policy's compiled layers (none for the full router), built once per policy object."""
        if policy is None:
            return {}
        key = id(policy)
        if key not in self._cache or self._cache[key][0] is not policy:
            if policy.is_identity:
                self._cache[key] = (policy, {})
                return {}
            device = self.layers[0].router.weight.device
            known = {l.index for l in self.layers}
            unknown = sorted(set(policy.layers) - known)
            if unknown:
                raise ValueError(f"policy names layers {unknown} that are not MoE layers of this model "
                                 f"(MoE layers: {sorted(known)})")
            compiled = {}
            for layer in self.layers:
                p = policy.for_layer(layer.index)
                if not p.is_identity:
                    try:
                        compiled[layer.index] = CompiledPolicy.build(p, layer.semantics, device,
                                                                     self.fold_tables.get(layer.index),
                                                                     self.constants.get(layer.index))
                    except ValueError as e:
                        raise ValueError(f"layer {layer.index}: {e}") from None
            self._cache[key] = (policy, compiled)
        return self._cache[key][1]

    def set_fold_tables(self, tables: dict[int, FoldTables], source: str | None = None) -> None:
        """Replace the ExFold tables folding policies compile with (compiled policies hold the old ones)."""
        self.fold_tables = dict(tables)
        self.fold_source = source
        self._cache.clear()

    def set_constants(self, constants: dict[int, torch.Tensor], source: str | None = None) -> None:
        """Replace the novice constants (MoE layer -> [E, H]) novice policies compile with."""
        self.constants = dict(constants)
        self.constants_source = source
        self._cache.clear()

    @contextmanager
    def policy(self, policy: PhasePolicy | None, token_top_k: torch.Tensor | None = None):
        """Run the forwards inside under ``policy`` (None = the full router) and per-token budgets
        ``token_top_k`` [T]: a routing-only step (plain SDPA attention, the experts loop). Yields the
        step (``runtime.step.read_experts(step)``: the experts its last forward read)."""
        num_layers = getattr(self.model.config, "num_hidden_layers", None) or max(l.index for l in self.layers) + 1
        step = Step(is_prefill=True, routing=Routing(self.compile(policy), token_top_k),
                    experts_read=experts_read_buffer(num_layers, self.layers[0].router.weight.device))
        with running(step):
            yield step

    @contextmanager
    def observing(self, observer: Observer):
        self.observers.append(observer)
        try:
            yield
        finally:
            self.observers.remove(observer)

    @staticmethod
    def one_budget(step: Step | None) -> bool:
        """Whether ``step`` routes every token at the same k: no per-token budgets, or budgets that all
        agree (``Routing.uniform``). The full router at top-min(k, budget) then gives the budgets' routes
        bit for bit (``route`` selects the step's largest k and trims nothing), so such a step keeps the
        native selection op and the bound decode graph."""
        return step is not None and (step.routing.token_top_k is None or step.routing.uniform)

    @staticmethod
    def native_top_k(layer: MoeLayer, step: Step) -> int:
        """The k a ``one_budget`` step routes ``layer`` at: the layer's, or the step's budget below it."""
        k_max = step.routing.k_max if step.routing.token_top_k is not None else None
        return layer.top_k if k_max is None else min(layer.top_k, int(k_max))

    def selects_natively(self, layer: MoeLayer, step: Step | None) -> bool:
        """Whether ``step`` routes ``layer`` with the full router through the native selection op alone
        (an engine decode step, no plan for the layer, one budget for every token: ``native_top_k``)."""
        return (step is not None and step.native.router and layer.index in self.native_routers
                and self.one_budget(step) and layer.index not in step.routing.policy)

    @classmethod
    def routes_every_layer_in_full(cls, step: Step | None) -> bool:
        """Whether ``step`` is an engine decode step with native selection, no plan and one budget for
        every token: every natively routed layer then selects as ``selects_natively`` says."""
        return (step is not None and step.native.router and cls.one_budget(step)
                and not step.routing.policy)

    def route_layer(self, layer: MoeLayer, hidden_states: torch.Tensor, logits: torch.Tensor | None = None,
                    stock: tuple | None = None):
        """The layer's routes under the routing of the step being run (the stock router without one).
        ``logits`` [T, E]: the router's output where the caller computed it with the step's linear
        op (the engine decoder's stacked projection); only read in an engine decode step. ``stock``:
        the stock router's own (logits, weights, index), where it already ran (the forward hook)."""
        router = layer.router
        step = current()
        routing = step.routing if step is not None else None
        cp = routing.policy.get(layer.index) if routing is not None else None
        token_k, k_max = (routing.token_top_k, routing.k_max) if routing is not None else (None, None)
        native = step is not None and step.native.router and layer.index in self.native_routers \
            and hidden_states.dtype == router.weight.dtype                   # an engine decode step: native routing
        if cp is None and token_k is None and not native:
            logits, weights, index = stock if stock is not None else type(router).forward(router, hidden_states)
        else:
            hidden = hidden_states.reshape(-1, hidden_states.shape[-1])       # [T, H]
            if native and logits is not None:
                logits = logits.contiguous()                                  # [T, E]
            elif native and step.native.linear and (hidden.dtype == torch.float32
                                                    or hidden.shape[0] <= BF16_ROUTER_OP_ROWS):
                logits = torch.ops.moetailor.rows_linear(hidden.contiguous(), router.weight)  # [T, E] (fp32: any rows)
            else:
                logits = layer.router_logits(hidden)                          # [T, E]
            select = torch.ops.moetailor.softmax_topk if native else None
            if native and cp is None and self.one_budget(step):               # full routing (at one k): the selection is all
                weights, index = select(logits.float().contiguous(), self.native_top_k(layer, step),
                                        layer.semantics.normalise, None)
                weights = self._as_stock(weights, logits)
            else:
                weights, index = self.apply_policy(layer, logits, cp, token_k, k_max, select)
        if self.observers:
            hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
            for observer in self.observers:
                observer(layer, hidden, logits, weights, index)
        return logits, weights, index

    def apply_policy(self, layer: MoeLayer, logits: torch.Tensor, cp: CompiledPolicy | None, token_k: torch.Tensor | None,
               k_max: int | None, select_kernel) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` under the layer's compiled policy (the full router's, compiled once, for budgets alone)."""
        if cp is None:
            cp = self._full.get(layer.index)
            if cp is None:
                cp = self._full[layer.index] = CompiledPolicy.build(FULL, layer.semantics, logits.device)
        if token_k is not None and token_k.numel() != logits.shape[0]:
            raise RuntimeError(f"token_top_k has {token_k.numel()} entries for {logits.shape[0]} tokens")
        bias = None if layer.semantics.scoring == "softmax" else layer.router_bias   # only sigmoid routers have one
        weights, index = route(logits, layer.semantics, cp, bias, token_k, k_max, select_kernel=select_kernel)
        return self._as_stock(weights, logits), index

    def _as_stock(self, weights: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Routing weights in the dtype the stock router returns: cast back to the logits' (bf16 for a
        bf16 model) where the architecture's router does so (all but Mixtral)."""
        return weights.to(logits.dtype) if self.spec.cast_weights_to_logits_dtype else weights

    def remove(self) -> None:
        """Restore the stock routers and experts implementation."""
        for handle in self.hooks:
            handle.remove()
        for layer in self.layers:
            experts_impl.INSTALLED.pop(layer.experts, None)
        if self._previous_impl is not None:
            self.model.set_experts_implementation(self._previous_impl)
        _CONTROLLERS.pop(self.model, None)
