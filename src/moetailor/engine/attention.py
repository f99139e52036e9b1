"""Paged attention plugged into transformers' own attention modules.

``install(model)`` sets ``model.config._attn_implementation = "moetailor_paged"`` once, when the
engine's model runner is built. transformers then calls ``paged_attention(module, q, k, v, mask, ...)``
from every layer's stock attention module, after its projections, norms and rotary embedding. With
a step context set (``models.step_context``) it writes the new k/v into the block pool at the
step's slots and attends over each sequence's cached blocks; without one it is plain SDPA with the
mask transformers builds for SDPA, so the same model object still works for ``model.generate``.
In an engine step the model is called with packed input_ids [1, T] (all sequences of the step back
to back), explicit position_ids and no transformers cache, and no mask is built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.step_context import StepContext, get_context

IMPLEMENTATION = "moetailor_paged"


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs):
    ctx = get_context()
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    # query [1, nH, T, Dk], key [1, nKV, T, Dk], value [1, nKV, T, Dv]
    if ctx.probe is not None:
        ctx.probe[module.layer_idx] = (tuple(key.shape[1::2]), tuple(value.shape[1::2]), key.dtype)
    num_tokens = query.shape[2]
    if ctx.kv_cache is not None:
        k_cache, v_cache = ctx.kv_cache[module.layer_idx]                 # [N*bs, nKV, D]
        k_cache.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))     # [T, nKV, Dk]
        v_cache.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))   # [T, nKV, Dv]
    if ctx.is_prefill:
        # Prompts start at position 0 (no prefix cache), so a sequence attends to its own new k/v.
        cu = ctx.cu_seqlens or [0, num_tokens]
        if len(cu) == 2:
            o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
            return o.transpose(1, 2), None                                # [1, T, nH, Dv]
        out = query.new_empty(num_tokens, query.shape[1], value.shape[-1])   # [T, nH, Dv]
        for start, end in zip(cu[:-1], cu[1:]):
            o = F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                               is_causal=True, scale=scaling, enable_gqa=True)  # [1, nH, L, Dv]
            out[start:end] = o[0].transpose(0, 1)
        return out.unsqueeze(0), None                                     # [1, T, nH, Dv]
    # decode: one new token per sequence, attending over its cached positions read in place
    if ctx.native_attention is not None and _native_ok(k_cache, kwargs):
        q = query[0].transpose(0, 1).float().contiguous()                 # [B, nH, Dk]
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        o = ctx.native_attention(q, k_cache, v_cache, ctx.block_table, ctx.context_lens, ctx.block_size, scale)
        return o.to(query.dtype).unsqueeze(0), None                       # [1, B, nH, Dv]
    _slots(ctx)
    k_all = _cached(ctx, k_cache, query.dtype, "k")                       # [B, nKV, S, Dk]
    v_all = _cached(ctx, v_cache, query.dtype, "v")                       # [B, nKV, S, Dv]
    q = query[0].transpose(0, 1).unsqueeze(2)                             # [B, nH, 1, Dk]
    o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=ctx.kv_mask, scale=scaling,
                                       enable_gqa=True)                   # [B, nH, 1, Dv]
    return o.transpose(1, 2).reshape(1, num_tokens, query.shape[1], -1), None  # [1, B, nH, Dv]


def _native_ok(cache: torch.Tensor, kwargs: dict) -> bool:
    """The native kernel covers plain (grouped-query) softmax attention over an fp32 or bf16 cache
    (computed in fp32): no sinks, soft-capping or sliding window."""
    return (cache.dtype in (torch.float32, torch.bfloat16) and kwargs.get("s_aux") is None
            and kwargs.get("sinks") is None and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None)


def _slots(ctx: StepContext) -> None:
    """Pool slots of every cached position, for the gather path (once per step, from the block
    table): a slice of the pool for a lone sequence whose blocks are contiguous, else ``kv_slots``
    [B*S] and, unless every sequence has the same length, ``kv_mask``."""
    if ctx.kv_slots is not None:
        return
    table, lens, bs, longest = ctx.block_table, ctx.context_lens, ctx.block_size, ctx.kv_len
    width = (longest + bs - 1) // bs
    first = int(table[0, 0])
    if table.shape[0] == 1 and bool((table[0, :width] == torch.arange(first, first + width)).all()):
        ctx.kv_slots = slice(first * bs, first * bs + longest)
        return
    kv_slots = (table[:, :width, None] * bs + torch.arange(bs, device=table.device)).view(table.shape[0], -1)
    ctx.kv_slots = kv_slots[:, :longest].flatten()                       # [B*S]
    if int(lens.min()) != longest:
        ctx.kv_mask = (torch.arange(longest, device=table.device) < lens[:, None])[:, None, None, :]  # [B,1,1,S]


def _cached(ctx: StepContext, cache: torch.Tensor, dtype: torch.dtype, which: str) -> torch.Tensor:
    """The step's cached positions of one layer as [B, nKV, S, D]. A lone sequence whose blocks are
    contiguous in the pool is a view (``kv_slots`` is then a slice); otherwise only its blocks'
    slots are gathered, into a buffer reused by every layer and step."""
    slots = ctx.kv_slots
    if isinstance(slots, slice):
        return cache[slots].unsqueeze(0).transpose(1, 2).to(dtype)         # [1, nKV, S, D]
    shape = (slots.numel(), *cache.shape[1:])
    key = (which, shape[1:], cache.dtype)
    buf = ctx.kv_buffers.get(key) if ctx.kv_buffers is not None else None
    if buf is None or buf.shape[0] < shape[0]:
        buf = cache.new_empty(shape)
        if ctx.kv_buffers is not None:
            ctx.kv_buffers[key] = buf
    out = buf[:shape[0]]
    torch.index_select(cache, 0, slots, out=out)                           # [B*S, nKV, D]
    return out.view(-1, ctx.kv_len, *cache.shape[1:]).transpose(1, 2).to(dtype)  # [B, nKV, S, D]


def _mask(*args, **kwargs):
    """transformers' mask for this implementation: SDPA's outside engine steps, none inside them."""
    if get_context() is not None:
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPLEMENTATION, paged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, _mask)


def install(model) -> None:
    """Route the model's attention through ``paged_attention`` from now on (once, at runner build)."""
    register()
    model.config._attn_implementation = IMPLEMENTATION
