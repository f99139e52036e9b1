"""What differs between the supported MoE architectures, as data.

transformers 5.x gives every supported architecture the same MoE block shape: a router returning
``(router_logits, top_k_weights, top_k_index)`` and a fused experts module holding
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. What still differs is written here once:
the config key for the expert count, how scores are formed (softmax vs DeepSeek's grouped
sigmoid), whether the top-k weights are renormalised, and the shared expert.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class RouterSemantics:
    """How a layer's stock router turns logits into routes (from the architecture and config)."""

    num_experts: int
    top_k: int
    scoring: str                  # "softmax" | "sigmoid-grouped"
    normalise: bool               # renormalise the selected weights to sum to 1
    scaling: float = 1.0          # DeepSeek's routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    experts_key: str                  # config attribute holding the routed expert count
    scoring: str                      # "softmax" or "sigmoid-grouped" (DeepSeek-V3)
    norm_key: str | None              # config attribute for top-k renormalisation; None = always on
    shared_expert: str | None         # attribute of the MoE block holding the shared expert MLP
    shared_gate: str | None           # attribute holding the shared expert's sigmoid gate, if any
    shared_width_key: str | None      # config attribute for the shared expert's width
    cast_weights_to_logits_dtype: bool = True  # stock routers cast top-k weights back (mixtral does not)

    def num_experts(self, config) -> int:
        return int(getattr(config, self.experts_key))

    def normalises_top_k(self, config) -> bool:
        return True if self.norm_key is None else bool(getattr(config, self.norm_key))


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen2_moe": ArchSpec("qwen2_moe", "num_experts", "softmax", "norm_topk_prob", "shared_expert",
                          "shared_expert_gate", "shared_expert_intermediate_size"),
    "qwen3_moe": ArchSpec("qwen3_moe", "num_experts", "softmax", "norm_topk_prob", None, None, None),
    "olmoe": ArchSpec("olmoe", "num_experts", "softmax", "norm_topk_prob", None, None, None),
    "mixtral": ArchSpec("mixtral", "num_local_experts", "softmax", None, None, None, None,
                        cast_weights_to_logits_dtype=False),
    "deepseek_v3": ArchSpec("deepseek_v3", "n_routed_experts", "sigmoid-grouped", "norm_topk_prob", "shared_experts",
                            None, "n_shared_experts"),
}


class UnsupportedArchitecture(ValueError):
    pass


def arch_spec(config) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {model_type!r} is not supported; moetailor supports: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


LAYER_KEY = re.compile(r"^(?P<base>.*?\blayers\.)(?P<layer>\d+)\.(?P<rest>.+)$")


def split_layer_key(name: str) -> tuple[int, str] | None:
    """'model.layers.3.mlp.gate.weight' -> (3, 'mlp.gate.weight'); None outside the decoder layers."""
    m = LAYER_KEY.match(name)
    return (int(m["layer"]), m["rest"]) if m else None
