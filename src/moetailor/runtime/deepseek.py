"""The engine's decoder for DeepSeek-V3-style checkpoints (multi-head latent attention, grouped
sigmoid routing, dense first layers, an always-on shared expert), for prefill and decode steps alike.

transformers' DeepSeek-V3 decoder layer op for op over the step's tokens (gpt-fast's shape: weights
held here, shapes beside each line), so the engine runs no transformers module in its steps and the
tokens equal the module path's bit for bit. Attention is the engine's own (``attention.prefill_attention``
/ ``decode_attention``, over the expanded per-head k/v the paged pool holds), routing goes through the
routing controller (DeepSeek's grouped top-k, plans and budgets) and the experts through the step's
experts path. Each projection and norm runs the native linear and norm ops inside decode steps
where they take the layer (``decoder.native_linear``), else torch's; dense weights are packed copies where
the engine packs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.adapters import MoeLayer, decoder_layers, moe_layers
from . import attention
from .decoder import Norm, engine_weight, hooked, model_hooks, module_linear, rotary_table, runs_native
from .experts import experts_forward
from .step import Step


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor             # [N, K] (or packed for the native op)
    bias: torch.Tensor | None        # [N]
    native: bool                     # the native op takes it (``runs_native``): the op in decode steps, when packed always

    @classmethod
    def of(cls, module, pack: tuple = ()) -> "Linear | None":
        if module is None:
            return None
        bias = getattr(module, "bias", None)
        weight = engine_weight(module.weight, pack) if type(module) is torch.nn.Linear else module.weight.detach()
        return cls(weight, None if bias is None else bias.detach(), runs_native(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (the native op takes rows [T, K])."""
        if not self.native:
            return F.linear(x, self.weight, self.bias)
        return module_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)


@dataclass(frozen=True)
class Mlp:
    gate: Linear
    up: Linear
    down: Linear

    @classmethod
    def of(cls, module, pack: tuple = ()) -> "Mlp":
        return cls(*(Linear.of(m, pack) for m in (module.gate_proj, module.up_proj, module.down_proj)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))                  # [T, H]


@dataclass(frozen=True)
class MlaLayer:
    index: int
    input_norm: Norm
    post_norm: Norm
    q: Linear | None                 # [nH Dqk, H], or None with a q LoRA:
    q_a: Linear | None               # [Rq, H]
    q_a_norm: Norm | None
    q_b: Linear | None               # [nH Dqk, Rq]
    kv_a: Linear                     # [R + Dr, H]: the compressed k/v latent and the shared rotary key
    kv_a_norm: Norm
    kv_b: Linear                     # [nH (Dn + Dv), R]
    o: Linear                        # [H, nH Dv]
    moe: MoeLayer | None             # None: a dense layer (``first_k_dense_replace``)
    mlp: Mlp                         # the dense MLP, or the MoE block's shared expert


@dataclass(frozen=True)
class MlaDecoder:
    layers: tuple[MlaLayer, ...]
    embed: torch.Tensor              # [V, H]
    final_norm: Norm
    lm_head: Linear
    rotary: torch.nn.Module
    rotary_table: tuple[torch.Tensor, torch.Tensor] | None   # cos, sin [max_model_len, Dr] (static rope)
    heads: int
    nope_dim: int                    # Dn: the per-head key dims without rotary
    rope_dim: int                    # Dr
    value_dim: int                   # Dv
    latent_rank: int                 # R
    interleaved: bool                # rope_interleave: rotary pairs (x0, x1), (x2, x3), ...
    scaling: float
    hooks: tuple[dict, ...]
    own_hooks: int                   # the routing controller's router hooks among them

    @classmethod
    def build(cls, model, controller, max_model_len: int, pack: tuple = ()) -> "MlaDecoder | None":
        """The decoder of a DeepSeek-V3 checkpoint whose every attention layer is full attention, or None;
        ``pack``: the dtypes whose dense weights it reads packed (copies)."""
        cfg = model.config
        if cfg.model_type != "deepseek_v3" or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return None
        inner, head = model.model, model.get_output_embeddings()
        moe = {layer.index: layer for layer in moe_layers(model)}
        layers = []
        for index, block in enumerate(decoder_layers(model)):
            attn = block.self_attn
            norm = lambda m: None if m is None else Norm.of(m)   # noqa: E731
            layers.append(MlaLayer(
                index, Norm.of(block.input_layernorm), Norm.of(block.post_attention_layernorm),
                Linear.of(attn.q_proj, pack), Linear.of(attn.q_a_proj, pack), norm(attn.q_a_layernorm),
                Linear.of(attn.q_b_proj, pack), Linear.of(attn.kv_a_proj_with_mqa, pack),
                Norm.of(attn.kv_a_layernorm), Linear.of(attn.kv_b_proj, pack), Linear.of(attn.o_proj, pack),
                moe.get(index), Mlp.of(moe[index].shared_expert if index in moe else block.mlp, pack)))
        attn = decoder_layers(model)[0].self_attn
        tied = head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()   # the embedding reads it row-major
        return cls(tuple(layers), inner.embed_tokens.weight, Norm.of(inner.norm), Linear.of(head, () if tied else pack),
                   inner.rotary_emb,
                   rotary_table(inner.rotary_emb, inner.embed_tokens.weight, max_model_len), attn.num_heads,
                   attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank,
                   bool(getattr(cfg, "rope_interleave", False)), float(attn.scaling), model_hooks(model),
                   len(controller.hooks))

    def hooked(self) -> bool:
        return hooked(self.hooks, self.own_hooks)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, step: Step, controller,
                keep: torch.Tensor) -> torch.Tensor:
        """A prefill step: ids [T], positions [T] -> logits [K, V] of the rows ``keep`` [K]."""
        return self.run(ids, positions, step, controller, keep)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: Step, controller) -> torch.Tensor:
        """A decode step: ids [B], positions [B] -> logits [B, V]."""
        return self.run(ids, positions, step, controller, None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, step: Step, controller,
            keep: torch.Tensor | None) -> torch.Tensor:
        x = F.embedding(ids, self.embed)                                      # [T, H] the residual stream
        if self.rotary_table is not None:
            cos, sin = (t[positions][None] for t in self.rotary_table)        # [1, T, Dr] each
        else:
            cos, sin = self.rotary(x, positions[None])                        # [1, T, Dr] each
        kernel = torch.ops.moetailor.rms_norm if step.native.norm else None
        for layer in self.layers:
            h = self.norm(layer.input_norm, x, kernel)                        # [T, H]
            x = x + layer.o(self.attention(layer, h, cos, sin, step, kernel))  # [T, H]
            h = self.norm(layer.post_norm, x, kernel)
            if layer.moe is None:
                x = x + layer.mlp(h)                                          # a dense layer
            else:
                _, weights, index = controller.route_layer(layer.moe, h)      # [T, K] each
                x = x + (experts_forward(layer.moe.experts, h, index, weights) + layer.mlp(h))
        h = self.norm(self.final_norm, x, kernel)                             # [T, H]
        return self.lm_head(h if keep is None else h[keep])                   # [T | K, V]

    @staticmethod
    def norm(norm: Norm, x: torch.Tensor, kernel) -> torch.Tensor:
        """The RMSNorm the engine's module runs: the step's native op on input of the weight's dtype."""
        return norm(x, kernel if x.dtype == norm.weight.dtype else None)

    def attention(self, layer: MlaLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
                  kernel) -> torch.Tensor:
        """Multi-head latent attention of ``h`` [T, H] -> [T, nH Dv], transformers' arithmetic."""
        T, nH, Dn, Dr, Dv, R = h.shape[0], self.heads, self.nope_dim, self.rope_dim, self.value_dim, self.latent_rank
        if layer.q is not None:
            q = layer.q(h)                                                    # [T, nH (Dn + Dr)]
        else:
            q = layer.q_b(self.norm(layer.q_a_norm, layer.q_a(h), kernel))    # [T, nH (Dn + Dr)]
        q = q.view(1, T, nH, Dn + Dr).transpose(1, 2)                         # [1, nH, T, Dn + Dr]
        q_pass, q_rot = torch.split(q, [Dn, Dr], dim=-1)
        latent, k_rot = torch.split(layer.kv_a(h), [R, Dr], dim=-1)           # [T, R], [T, Dr]
        latent = self.norm(layer.kv_a_norm, latent, kernel).view(1, 1, T, R)  # [1, 1, T, R]
        k_rot = k_rot.view(1, 1, T, Dr)
        q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)                    # [1, nH | 1, T, Dr]
        query = torch.cat((q_pass, q_rot), dim=-1)                            # [1, nH, T, Dn + Dr]
        kv = layer.kv_b(latent).view(1, T, -1, Dn + Dv).transpose(1, 2)       # [1, nH, T, Dn + Dv]
        k_nope, value = torch.split(kv, [Dn, Dv], dim=-1)
        key = kv.new_empty(*kv.shape[:-1], Dn + Dr)                           # [1, nH, T, Dn + Dr]
        key[..., :Dn].copy_(k_nope)
        key[..., Dn:].copy_(k_rot.expand(-1, nH, -1, -1))
        attend = attention.prefill_attention if step.is_prefill else attention.decode_attention
        o = attend(query, key, value, step.kv, layer.index, self.scaling)    # [1, T, nH, Dv]
        return o.reshape(T, nH * Dv)                                          # [T, nH Dv]

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """transformers' rotary embedding of q [1, nH, T, Dr] and k [1, 1, T, Dr] (cos, sin [1, T, Dr])."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                         # [1, 1, T, Dr]
        if self.interleaved:   # the rotary pairs are (x0, x1), (x2, x3), ...: each rotated on its even/odd slices
            cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
            return tuple(torch.cat([t[..., 0::2] * cos - t[..., 1::2] * sin, t[..., 1::2] * cos + t[..., 0::2] * sin],
                                   dim=-1) for t in (q, k))
        return tuple((t * cos) + (rotate_half(t) * sin) for t in (q, k))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
