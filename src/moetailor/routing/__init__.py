"""Routing: the shared representation of which experts run with what weight, and where it applies."""
from .controller import RoutingController
from .policy import FULL, FULL_PHASE, LayerPolicy, PhasePolicy
from .router import CompiledPolicy, FoldTables, RouterSemantics, route

__all__ = ["RoutingController", "FULL", "FULL_PHASE", "LayerPolicy", "PhasePolicy", "CompiledPolicy",
           "FoldTables", "RouterSemantics", "route"]
