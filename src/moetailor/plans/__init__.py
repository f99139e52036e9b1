"""Plans: which experts run, per layer and per phase (the artifact every technique writes)."""
from .plan import PHASES, Plan, PlanMismatch, uniform_plan

__all__ = ["PHASES", "Plan", "PlanMismatch", "uniform_plan"]
