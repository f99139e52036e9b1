"""A uniform view of the sparse MoE layers of a transformers model.

``moe_layers(model)`` returns one ``MoeLayer`` per sparse block with its router, fused experts,
shared expert and routing semantics. Later code reads weights through this view and changes
routing only through ``routing.controller.RoutingController`` (a router ``__class__`` swap, so
the module tree, state dict and output recording stay stock).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .architectures import ArchSpec, RouterSemantics, arch_spec


@dataclass
class MoeLayer:
    index: int                    # decoder layer index
    block: nn.Module              # the sparse MoE block (``layer.mlp``)
    router: nn.Module             # ``block.gate``: weight [E, H] (and DeepSeek's e_score_correction_bias)
    experts: nn.Module            # gate_up_proj [E, 2I, H], down_proj [E, H, I]
    shared_expert: nn.Module | None
    shared_gate: nn.Module | None
    semantics: RouterSemantics

    @property
    def num_experts(self) -> int:
        return self.semantics.num_experts

    @property
    def top_k(self) -> int:
        return self.semantics.top_k

    @property
    def hidden_size(self) -> int:
        return self.router.weight.shape[1]

    @property
    def router_bias(self) -> torch.Tensor | None:
        return getattr(self.router, "e_score_correction_bias", None)

    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-activation router scores [T, E] exactly as the stock router computes them."""
        if self.semantics.scoring == "sigmoid-grouped":
            return F.linear(hidden.float(), self.router.weight.float())
        return F.linear(hidden, self.router.weight)

    def expert_forward(self, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """E_e(x) for rows of hidden [N, H] -> [N, H], without the gate weight."""
        gate, up = F.linear(hidden, self.experts.gate_up_proj[expert]).chunk(2, dim=-1)  # [N, I] each
        return F.linear(self.experts.act_fn(gate) * up, self.experts.down_proj[expert])

    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights (gate, up, down)."""
        w = self.experts.gate_up_proj
        return (w[0].numel() + self.experts.down_proj[0].numel()) * w.element_size()


def semantics_for(config, spec: ArchSpec) -> RouterSemantics:
    return RouterSemantics(
        num_experts=spec.num_experts(config), top_k=int(config.num_experts_per_tok), scoring=spec.scoring,
        normalise=spec.normalises_top_k(config), scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        n_group=int(getattr(config, "n_group", 1) or 1), topk_group=int(getattr(config, "topk_group", 1) or 1))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    if not hasattr(base, "layers"):
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers; is this a causal LM?")
    return base.layers


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """Every sparse MoE block of a supported model, in layer order (dense layers are skipped)."""
    spec = arch_spec(model.config)
    sem = semantics_for(model.config, spec)
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "experts") or not hasattr(block, "gate"):
            continue
        out.append(MoeLayer(
            index=i, block=block, router=block.gate, experts=block.experts,
            shared_expert=getattr(block, spec.shared_expert, None) if spec.shared_expert else None,
            shared_gate=getattr(block, spec.shared_gate, None) if spec.shared_gate else None,
            semantics=sem))
    if not out:
        raise ValueError(f"no sparse MoE layers found in {type(model).__name__}")
    return out


def describe(model: nn.Module) -> dict:
    """The facts `moetailor info` prints: architecture, layers, experts, top-k, gating, parameters."""
    config = model.config
    spec = arch_spec(config)
    layers = moe_layers(model)
    first = layers[0]
    expert_params = sum(l.experts.gate_up_proj.numel() + l.experts.down_proj.numel() for l in layers)
    shared_params = sum(sum(p.numel() for p in l.shared_expert.parameters()) for l in layers if l.shared_expert is not None)
    total = sum(p.numel() for p in model.parameters())
    per_expert = first.experts.gate_up_proj[0].numel() + first.experts.down_proj[0].numel()
    active = total - expert_params + len(layers) * first.top_k * per_expert
    norm = "sigmoid scores" if spec.scoring == "sigmoid-grouped" else "softmax"
    norm += ", top-k renormalised" if first.semantics.normalise else ", no renormalisation (softmax over all)"
    if spec.scoring == "sigmoid-grouped":
        norm += f", {first.semantics.n_group} groups (top {first.semantics.topk_group}), scaling {first.semantics.scaling}"
    shared = "none"
    if first.shared_expert is not None:
        shared = f"width {getattr(config, spec.shared_width_key)}" + (" (x moe width)" if spec.model_type == "deepseek_v3" else "")
        shared += ", sigmoid-gated" if first.shared_gate is not None else ", always on"
    return {
        "architecture": config.model_type,
        "class": type(model).__name__,
        "layers": len(decoder_layers(model)),
        "moe_layers": [l.index for l in layers],
        "hidden_size": config.hidden_size,
        "routed_experts_per_layer": first.num_experts,
        "top_k": first.top_k,
        "expert_width": first.experts.down_proj.shape[-1],
        "gate_normalisation": norm,
        "shared_expert": shared,
        "parameters_total": total,
        "parameters_routed_experts": expert_params,
        "parameters_shared_experts": shared_params,
        "parameters_active_per_token": active,
        "bytes_per_expert": first.expert_bytes(),
        "dtype": str(first.experts.gate_up_proj.dtype).replace("torch.", ""),
    }
