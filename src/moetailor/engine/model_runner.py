"""Runs one engine step on the model: packs the step's tokens, sets the paged-attention context,
holds the KV block pool, and returns the next-token logits of each sequence."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from . import attention
from ..routing import experts
from .attention import Context, paged_mode, step_context
from .config import EngineConfig
from .sequence import Sequence

DEFAULT_KV_CAP_BYTES = 512 * 2**20   # default pool cap when neither num_kv_blocks nor memory_budget is given


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (what the weights cost in memory)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


class ModelRunner:
    def __init__(self, model, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        attention.register()
        experts.register()
        self.experts_impl = experts.GROUPED_IMPLEMENTATION if config.experts_impl == "grouped" else None
        limit = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        if config.max_model_len is None:
            config.max_model_len = min(limit, 4096)
        elif config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}")
        self._check_attention()
        self.kv_shapes = self._probe_kv_shapes()          # layer -> ((nKV, Dk), (nKV, Dv), dtype)
        self.block_bytes = config.block_size * sum(
            (k[0] * k[1] + v[0] * v[1]) for k, v, _ in self.kv_shapes.values()) * self.kv_dtype.itemsize
        self.weight_bytes = model_bytes(model)
        self.num_blocks = self._num_blocks()
        self.kv_cache = self._allocate()

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.config.dtype

    def _check_attention(self) -> None:
        for name, module in self.model.named_modules():
            window = getattr(module, "sliding_window", None)
            if hasattr(module, "layer_idx") and window is not None and window < self.config.max_model_len:
                raise ValueError(f"{name} uses sliding-window attention (window {window}), which the paged engine "
                                 f"does not implement; set max_model_len <= {window}")

    def _probe_kv_shapes(self) -> dict:
        """Run one token through the model to learn each layer's k/v head shapes (works for MLA too)."""
        probe: dict = {}
        ctx = Context(is_prefill=True, slot_mapping=torch.zeros(1, dtype=torch.long, device=self.device), probe=probe)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with paged_mode(self.model), step_context(ctx), torch.inference_mode():
            self.model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1)
        if not probe:
            raise ValueError(f"{type(self.model).__name__} did not call transformers' attention interface; "
                             "the paged engine needs a model whose attention uses AttentionInterface")
        return {layer: probe[layer] for layer in sorted(probe)}

    def blocks_for_budget(self, budget: int) -> int:
        """KV blocks that fit in ``budget`` bytes after the weights."""
        return max(0, (budget - self.weight_bytes) // self.block_bytes)

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.memory_budget is not None:
            n = self.blocks_for_budget(c.memory_budget)
            if n < 1:
                raise ValueError(f"memory_budget={c.memory_budget:,} bytes leaves no room for KV blocks after "
                                 f"{self.weight_bytes:,} bytes of weights; raise the budget")
            return n
        per_seq = (c.max_model_len + c.block_size - 1) // c.block_size
        return max(per_seq, min(c.max_num_seqs * per_seq, DEFAULT_KV_CAP_BYTES // self.block_bytes))

    def _allocate(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per attention layer_idx: (k, v) pools [num_blocks * block_size, nKV, D]."""
        # zeros, not empty: unwritten slots of a sequence's last block are masked, but NaN garbage would
        # still leak through 0 * NaN in the value product.
        slots = self.num_blocks * self.config.block_size
        cache: list = [None] * (max(self.kv_shapes) + 1)
        for layer, (k, v, _) in self.kv_shapes.items():
            cache[layer] = (torch.zeros(slots, *k, dtype=self.kv_dtype, device=self.device),
                            torch.zeros(slots, *v, dtype=self.kv_dtype, device=self.device))
        return cache

    def read_blocks(self, block_table: list[int]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of the KV held in ``block_table``: per layer (k, v) [n_blocks * block_size, nKV, D]."""
        bs = self.config.block_size
        slots = (torch.tensor(block_table, device=self.device)[:, None] * bs
                 + torch.arange(bs, device=self.device)[None, :]).flatten()
        return [None if kv is None else (kv[0][slots].clone(), kv[1][slots].clone()) for kv in self.kv_cache]

    def write_blocks(self, block_table: list[int], blocks: list) -> None:
        """Store KV produced elsewhere (``read_blocks`` of another runner) into ``block_table``."""
        bs = self.config.block_size
        slots = (torch.tensor(block_table, device=self.device)[:, None] * bs
                 + torch.arange(bs, device=self.device)[None, :]).flatten()
        for kv, new in zip(self.kv_cache, blocks):
            if kv is not None:
                kv[0][slots] = new[0].to(kv[0].device, kv[0].dtype)
                kv[1][slots] = new[1].to(kv[1].device, kv[1].dtype)

    def prepare_prefill(self, seqs: list[Sequence], block_manager) -> tuple[list[int], list[int], Context]:
        ids, positions, slots, cu = [], [], [], [0]
        for seq in seqs:
            n = len(seq)
            ids += seq.token_ids
            positions += range(n)
            slots += block_manager.slots(seq, 0, n)
            cu.append(cu[-1] + n)
        ctx = Context(is_prefill=True, slot_mapping=self._tensor(slots), cu_seqlens=cu,
                      kv_cache=self.kv_cache, block_size=self.config.block_size)
        return ids, positions, ctx

    def prepare_decode(self, seqs: list[Sequence], block_manager) -> tuple[list[int], list[int], Context]:
        bs = self.config.block_size
        ids = [seq.token_ids[-1] for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        slots = [block_manager.slots(seq, len(seq) - 1, len(seq))[0] for seq in seqs]
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                              dtype=torch.long, device=self.device)                   # [B, nb]
        lens = torch.tensor([len(seq) for seq in seqs], device=self.device)           # [B]
        mask = torch.arange(width * bs, device=self.device)[None, :] < lens[:, None]  # [B, S]
        ctx = Context(is_prefill=False, slot_mapping=self._tensor(slots), block_tables=tables,
                      kv_mask=mask[:, None, None, :], kv_cache=self.kv_cache, block_size=bs)
        return ids, positions, ctx

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, block_manager,
            every_position: list[bool] | None = None) -> torch.Tensor:
        """Next-token logits [B, V] (float32) for the step's sequences. In a prefill step,
        ``every_position[i]`` keeps all of sequence i's rows instead of its last one (prompt
        logprobs): then the result is [sum of kept rows, V], in sequence order."""
        prepare = self.prepare_prefill if is_prefill else self.prepare_decode
        ids, positions, ctx = prepare(seqs, block_manager)
        input_ids = self._tensor(ids)[None]                                           # [1, T]
        position_ids = self._tensor(positions)[None]                                  # [1, T]
        keep = 0
        if is_prefill:
            every = every_position or [False] * len(seqs)
            cu = ctx.cu_seqlens
            keep = self._tensor([p for i, all_rows in enumerate(every)
                                 for p in (range(cu[i], cu[i + 1]) if all_rows else [cu[i + 1] - 1])])  # [K]
        cast = self.config.prefill_dtype if is_prefill else None
        autocast = torch.autocast(self.device.type, dtype=cast) if cast is not None and cast != self.config.dtype \
            else nullcontext()
        with paged_mode(self.model), experts.experts_mode(self.model, self.experts_impl), step_context(ctx), autocast:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep)
        return out.logits[0].float()                                                  # [B or K, V]
