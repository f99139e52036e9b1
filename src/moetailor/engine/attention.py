"""Paged attention plugged into transformers' own attention modules.

During its steps the engine sets ``model.config._attn_implementation = "moetailor_paged"``
(``paged_mode``) and restores it after, so the model object stays stock for other users. transformers then
calls ``paged_attention(module, q, k, v, mask, ...)`` from every layer's stock attention module,
after its projections, norms and rotary embedding. With a step ``Context`` set, it writes the new
k/v into the block pool at the step's slots and attends over each sequence's cached blocks;
without one it is plain SDPA, so the same model object still works for ``model.generate``.
The model is called with packed input_ids [1, T] (all sequences of the step back to back),
explicit position_ids and no transformers cache; no mask is built for a custom implementation.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IMPLEMENTATION = "moetailor_paged"


@dataclass
class Context:
    is_prefill: bool
    slot_mapping: torch.Tensor                  # [T] pool slot of each new token
    cu_seqlens: list[int] | None = None         # prefill: token offsets of each sequence (len B+1)
    block_tables: torch.Tensor | None = None    # decode: [B, max_blocks] (padding -> block 0, masked)
    kv_mask: torch.Tensor | None = None         # decode: [B, 1, 1, max_blocks*block_size] True = attend
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v): [N*bs, nKV, D]
    block_size: int = 16
    probe: dict | None = None                   # shape discovery: layer -> (k shape, v shape, dtype)


_CONTEXT: Context | None = None


@contextmanager
def step_context(ctx: Context):
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = previous


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs):
    ctx = _CONTEXT
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    # query [1, nH, T, Dk], key [1, nKV, T, Dk], value [1, nKV, T, Dv]
    if ctx.probe is not None:
        ctx.probe[module.layer_idx] = (tuple(key.shape[1::2]), tuple(value.shape[1::2]), key.dtype)
    num_tokens = query.shape[2]
    k_new = key[0].transpose(0, 1)                                        # [T, nKV, Dk]
    v_new = value[0].transpose(0, 1)                                      # [T, nKV, Dv]
    if ctx.kv_cache is not None:
        k_cache, v_cache = ctx.kv_cache[module.layer_idx]                 # [N*bs, nKV, D]
        k_cache.index_copy_(0, ctx.slot_mapping, k_new.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.slot_mapping, v_new.to(v_cache.dtype))
    if ctx.is_prefill:
        # Prompts start at position 0 (no prefix cache), so a sequence attends to its own new k/v.
        out = query.new_empty(num_tokens, query.shape[1], value.shape[-1])   # [T, nH, Dv]
        cu = ctx.cu_seqlens or [0, num_tokens]
        for start, end in zip(cu[:-1], cu[1:]):
            o = F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                               is_causal=True, scale=scaling, enable_gqa=True)  # [1, nH, L, Dv]
            out[start:end] = o[0].transpose(0, 1)
        return out.unsqueeze(0), None                                     # [1, T, nH, Dv]
    # decode: one new token per sequence, attending over its blocks
    n_blocks = ctx.block_tables.shape[1]
    bs = ctx.block_size
    k_all = k_cache.view(-1, bs, *k_cache.shape[1:])[ctx.block_tables]   # [B, nb, bs, nKV, Dk]
    v_all = v_cache.view(-1, bs, *v_cache.shape[1:])[ctx.block_tables]   # [B, nb, bs, nKV, Dv]
    k_all = k_all.flatten(1, 2).transpose(1, 2).to(query.dtype)          # [B, nKV, S, Dk]
    v_all = v_all.flatten(1, 2).transpose(1, 2).to(query.dtype)          # [B, nKV, S, Dv]
    q = query[0].transpose(0, 1).unsqueeze(2)                             # [B, nH, 1, Dk]
    o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=ctx.kv_mask, scale=scaling,
                                       enable_gqa=True)                   # [B, nH, 1, Dv]
    assert n_blocks * bs == k_all.shape[2]
    return o.transpose(1, 2).reshape(1, num_tokens, query.shape[1], -1), None  # [1, B, nH, Dv]


@contextmanager
def paged_mode(model):
    """Route the model's attention through ``paged_attention`` (no mask is built for it)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = previous


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention)
