"""Installs routing control on a model; the caller chooses the active phase policy per step.

The stock router's ``__class__`` is swapped for a subclass whose forward asks the controller.
With no policy active it runs the stock forward unchanged, so the full model is reproduced
bit for bit; observers (calibration, the guard) see every layer's inputs and routes.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn

from ..models.adapters import MoeLayer, moe_layers
from ..models.architectures import arch_spec
from ..models.step_context import get_context
from . import experts as experts_impl
from .policy import FULL, PhasePolicy
from .router import CompiledPolicy, FoldTables, route

# observer(layer, hidden [T, H], logits [T, E], weights [T, K], index [T, K])
Observer = Callable[[MoeLayer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_SUBCLASSES: dict[type, type] = {}


def _controlled(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def forward(self, hidden_states):
            return self._moetailor_controller._route(self._moetailor_layer, hidden_states)
        _SUBCLASSES[cls] = type(f"Controlled{cls.__name__}", (cls,), {"forward": forward, "_moetailor_base": cls})
    return _SUBCLASSES[cls]


class RoutingController:
    """One per model. ``use(policy)`` sets the phase policy; ``observe`` adds observers."""

    def __init__(self, model: nn.Module, fold_tables: dict[int, FoldTables] | None = None):
        if getattr(model, "_moetailor_controller", None) is not None:
            raise RuntimeError("this model already has a RoutingController; reuse model._moetailor_controller")
        self.model = model
        self.spec = arch_spec(model.config)
        self.layers = moe_layers(model)
        self.fold_tables = fold_tables or {}
        self.fold_source: str | None = None   # where fold_tables came from (a statistics file)
        self.meter = experts_impl.TrafficMeter(enabled=True)
        self.observers: list[Observer] = []
        self.token_top_k: torch.Tensor | None = None  # [T] per-token budget (per-request k), or None
        self._active: dict[int, CompiledPolicy] = {}
        self._cache: dict[int, tuple[PhasePolicy, dict[int, CompiledPolicy]]] = {}
        self._full: dict[int, CompiledPolicy] = {}   # layer -> the full router compiled (per-token budgets only)
        experts_impl.register()
        for layer in self.layers:
            layer.router.__class__ = _controlled(type(layer.router))
            layer.router._moetailor_controller = self
            layer.router._moetailor_layer = layer
            layer.experts._moetailor_meter = self.meter
            layer.experts._moetailor_layer = layer.index
        self._previous_impl = getattr(model.config, "_experts_implementation", None)
        model.set_experts_implementation(experts_impl.IMPLEMENTATION)
        model._moetailor_controller = self

    @classmethod
    def of(cls, model: nn.Module) -> "RoutingController":
        """The model's controller, installing one if needed."""
        return getattr(model, "_moetailor_controller", None) or cls(model)

    def compile(self, policy: PhasePolicy | None) -> dict[int, CompiledPolicy]:
        if policy is None or policy.is_identity:
            return {}
        key = id(policy)
        if key not in self._cache or self._cache[key][0] is not policy:
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
                                                                     self.fold_tables.get(layer.index))
                    except ValueError as e:
                        raise ValueError(f"layer {layer.index}: {e}") from None
            self._cache[key] = (policy, compiled)
        return self._cache[key][1]

    def set_fold_tables(self, tables: dict[int, FoldTables], source: str | None = None) -> None:
        """Replace the ExFold tables folding policies compile with (compiled policies hold the old ones)."""
        self.fold_tables = dict(tables)
        self.fold_source = source
        self._cache.clear()

    def use(self, policy: PhasePolicy | None) -> None:
        self._active = self.compile(policy)

    @contextmanager
    def policy(self, policy: PhasePolicy | None, token_top_k: torch.Tensor | None = None):
        previous, previous_k = self._active, self.token_top_k
        self.use(policy)
        self.token_top_k = token_top_k
        try:
            yield self
        finally:
            self._active, self.token_top_k = previous, previous_k

    @contextmanager
    def observing(self, observer: Observer):
        self.observers.append(observer)
        try:
            yield
        finally:
            self.observers.remove(observer)

    def _route(self, layer: MoeLayer, hidden_states: torch.Tensor):
        """The layer's routes under the engine step's context when one is set, else under ``policy``."""
        router = layer.router
        ctx = get_context()
        if ctx is not None:
            cp, token_k, k_max = ctx.policy.get(layer.index), ctx.token_top_k, ctx.k_max
        else:
            cp, token_k, k_max = self._active.get(layer.index), self.token_top_k, None
        if cp is None and token_k is None:
            logits, weights, index = router._moetailor_base.forward(router, hidden_states)
        else:
            hidden = hidden_states.reshape(-1, hidden_states.shape[-1])       # [T, H]
            logits = layer.router_logits(hidden)                              # [T, E]
            if cp is None:
                cp = self._full.get(layer.index)
                if cp is None:
                    cp = self._full[layer.index] = CompiledPolicy.build(FULL, layer.semantics, logits.device)
            if token_k is not None and token_k.numel() != logits.shape[0]:
                raise RuntimeError(f"token_top_k has {token_k.numel()} entries for {logits.shape[0]} tokens")
            weights, index = route(logits, layer.semantics, cp, layer.router_bias, token_k, k_max)
            if self.spec.cast_weights_to_logits_dtype:
                weights = weights.to(logits.dtype)
        if self.observers:
            hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
            for observer in self.observers:
                observer(layer, hidden, logits, weights, index)
        return logits, weights, index

    def remove(self) -> None:
        """Restore the stock routers and experts implementation."""
        for layer in self.layers:
            layer.router.__class__ = layer.router._moetailor_base
            for attr in ("_moetailor_controller", "_moetailor_layer"):
                delattr(layer.router, attr)
            layer.experts._moetailor_meter = None
        if self._previous_impl is not None:
            self.model.set_experts_implementation(self._previous_impl)
        self.model._moetailor_controller = None

