"""Model adapters: a uniform view of MoE layers across architectures, loading, tiny test models."""
from .adapters import MoeLayer, describe, moe_layers
from .architectures import ARCHITECTURES, UnsupportedArchitecture, arch_spec
from .loading import REFERENCE_DIR, load_model, load_tokenizer, resolve_model_path

__all__ = ["MoeLayer", "describe", "moe_layers", "ARCHITECTURES", "UnsupportedArchitecture", "arch_spec",
           "REFERENCE_DIR", "load_model", "load_tokenizer", "resolve_model_path"]
