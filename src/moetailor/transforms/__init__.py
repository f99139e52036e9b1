"""Transforms that write new checkpoints from a model and a plan (pruning)."""
from .prune import SIDECAR, kept_per_layer, prune_checkpoint, pruned_state, read_sidecar

__all__ = ["SIDECAR", "kept_per_layer", "prune_checkpoint", "pruned_state", "read_sidecar"]
