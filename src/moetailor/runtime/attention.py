"""Paged attention plugged into transformers' own attention modules.

``install(model)`` sets ``model.config._attn_implementation = "moetailor_paged"`` once, when the
engine's model runner is built. transformers then calls ``paged_attention(module, q, k, v, mask, ...)``
from every layer's stock attention module, after its projections, norms and rotary embedding. With
an engine step set (``runtime.step``: its ``kv``) it writes the new k/v into the block pool at the
step's slots and attends over each sequence's cached blocks; without one it is plain SDPA with the
mask transformers builds for SDPA, so the same model object still works for ``model.generate``.
In an engine step the model is called with packed input_ids [1, T] (all sequences of the step back
to back), explicit position_ids and no transformers cache, and no mask is built. Everything it
reads is in the step's ``PagedKV`` (built by the model runner, with the gather path's slots,
mask and buffers worked out before the forward): attention only reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .step import PagedKV, current

IMPLEMENTATION = "moetailor_paged"


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs):
    step = current()
    if step is not None and step.probe is not None:
        step.probe[module.layer_idx] = (tuple(key.shape[1::2]), tuple(value.shape[1::2]), native_ok(kwargs))
    kv = step.kv if step is not None else None
    if kv is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if step.is_prefill:
        return prefill_attention(query, key, value, kv, module.layer_idx, scaling), None    # [1, T, nH, Dv]
    return decode_attention(query, key, value, kv, module.layer_idx, scaling), None   # [1, B, nH, Dv]


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: PagedKV, layer: int,
                     scaling: float | None) -> torch.Tensor:
    """A decode step's attention: one new token per sequence, its k/v written into the pool, then
    attending over the sequence's cached positions, read in place by the native kernel or gathered
    (the step's slots and buffers). query [1, nH, B, Dk], key [1, nKV, B, Dk], value [1, nKV, B, Dv]
    -> [1, B, nH, Dv]. Both the module path and the engine's decoders call it."""
    num_tokens = query.shape[2]
    k_cache, v_cache = kv.cache[layer]                                    # [N*bs, nKV, D]
    k_cache.index_copy_(0, kv.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))     # [B, nKV, Dk]
    v_cache.index_copy_(0, kv.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))   # [B, nKV, Dv]
    if kv.native:
        q = query[0].transpose(0, 1).float().contiguous()                 # [B, nH, Dk]
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        o = torch.ops.moetailor.paged_decode_attention(q, k_cache, v_cache, kv.block_table, kv.context_lens,
                                                       kv.block_size, scale)
        return o.to(query.dtype).unsqueeze(0)                             # [1, B, nH, Dv]
    k_all = _cached(kv, k_cache, query.dtype, "k")                        # [B, nKV, S, Dk]
    v_all = _cached(kv, v_cache, query.dtype, "v")                        # [B, nKV, S, Dv]
    q = query[0].transpose(0, 1).unsqueeze(2)                             # [B, nH, 1, Dk]
    o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=kv.kv_mask, scale=scaling,
                                       enable_gqa=True)                   # [B, nH, 1, Dv]
    return o.transpose(1, 2).reshape(1, num_tokens, query.shape[1], -1)  # [1, B, nH, Dv]


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: PagedKV, layer: int,
                      scaling: float | None) -> torch.Tensor:
    """A prefill step's attention: the new k/v written into the pool at the step's slots, then each
    sequence causal over its own new k/v (prompts start at position 0: no prefix cache).
    query [1, nH, T, Dk], key [1, nKV, T, Dk], value [1, nKV, T, Dv] -> [1, T, nH, Dv]. Both the
    module path (``paged_attention``) and the engine's decoder (``runtime.decoder``) call it."""
    num_tokens = query.shape[2]
    k_cache, v_cache = kv.cache[layer]                                    # [N*bs, nKV, D]
    k_cache.index_copy_(0, kv.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))     # [T, nKV, Dk]
    v_cache.index_copy_(0, kv.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))   # [T, nKV, Dv]
    cu = kv.cu_seqlens or (0, num_tokens)
    if len(cu) == 2:
        o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return o.transpose(1, 2)                                          # [1, T, nH, Dv]
    out = query.new_empty(num_tokens, query.shape[1], value.shape[-1])   # [T, nH, Dv]
    for start, end in zip(cu[:-1], cu[1:]):
        o = F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                           is_causal=True, scale=scaling, enable_gqa=True)  # [1, nH, L, Dv]
        out[start:end] = o[0].transpose(0, 1)
    return out.unsqueeze(0)                                               # [1, T, nH, Dv]


def native_ok(kwargs: dict) -> bool:
    """Whether the native kernel covers a layer called with ``kwargs``: plain (grouped-query) softmax
    attention, no sinks, soft-capping or sliding window (the runner asks once, in its shape probe;
    it also needs an fp32 or bf16 cache)."""
    return all(kwargs.get(name) is None for name in ("s_aux", "sinks", "softcap", "sliding_window"))


def gather_slots(block_table: torch.Tensor, lens: list[int], block_size: int
                 ) -> tuple[torch.Tensor | slice, torch.Tensor | None]:
    """Pool slots of every cached position of a decode step, for the gather path (built once per
    step by the runner, from the block table [B, nb] and the lengths): a slice of the pool for a lone
    sequence whose blocks are contiguous, else [B*S] and, unless every sequence has the same length,
    the mask [B, 1, 1, S] (True = attend)."""
    bs, longest = block_size, max(lens)
    width = (longest + bs - 1) // bs
    first = int(block_table[0, 0])
    if block_table.shape[0] == 1 and bool((block_table[0, :width] == torch.arange(first, first + width)).all()):
        return slice(first * bs, first * bs + longest), None
    kv_slots = (block_table[:, :width, None] * bs + torch.arange(bs, device=block_table.device)).view(
        block_table.shape[0], -1)
    mask = None
    if min(lens) != longest:
        lengths = torch.tensor(lens, device=block_table.device)
        mask = (torch.arange(longest, device=block_table.device) < lengths[:, None])[:, None, None, :]  # [B,1,1,S]
    return kv_slots[:, :longest].flatten(), mask                          # [B*S]


def gather_buffers(cache: list, num_slots: int, workspace: dict) -> dict:
    """The gather path's buffers [num_slots, nKV, D] for the pool ``cache`` (per layer (k, v)): one
    per (k|v, (nKV, D), dtype), shared by every layer, grown in ``workspace`` (the runner's, kept
    across steps) as needed."""
    out = {}
    for pair in cache:
        for which, pool in zip("kv", pair if pair is not None else ()):
            key = (which, tuple(pool.shape[1:]), pool.dtype)
            if key in out:
                continue
            buf = workspace.get(key)
            if buf is None or buf.shape[0] < num_slots:
                buf = workspace[key] = pool.new_empty(num_slots, *pool.shape[1:])
            out[key] = buf[:num_slots]
    return out


def _cached(kv: PagedKV, cache: torch.Tensor, dtype: torch.dtype, which: str) -> torch.Tensor:
    """The step's cached positions of one layer as [B, nKV, S, D]. A lone sequence whose blocks are
    contiguous in the pool is a view (``kv_slots`` is then a slice); otherwise only its blocks'
    slots are gathered, into the step's buffer for this shape."""
    slots = kv.kv_slots
    if isinstance(slots, slice):
        return cache[slots].unsqueeze(0).transpose(1, 2).to(dtype)         # [1, nKV, S, D]
    out = kv.gather[(which, tuple(cache.shape[1:]), cache.dtype)]
    torch.index_select(cache, 0, slots, out=out)                           # [B*S, nKV, D]
    return out.view(-1, kv.kv_len, *cache.shape[1:]).transpose(1, 2).to(dtype)  # [B, nKV, S, D]


def _mask(*args, **kwargs):
    """transformers' mask for this implementation: SDPA's outside engine steps, none inside them."""
    step = current()
    if step is not None and step.kv is not None:
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
