"""Runs one engine step on the model: ``prepare_prefill`` / ``prepare_decode`` pack the step's
tokens and build its one ``Step`` (KV slots, block tables, lengths, the phase's routing with the
per-token budgets, the decode expert weights by layer), ``run`` runs the forward under it and
returns a ``StepOutput`` (next-token logits and the experts the step read). The runner also holds
the KV block pool. Paged attention is installed on the model once, here (the routing controller,
with the experts implementation, by whoever builds the runner); nothing about the model changes per
step, and no class of it is swapped: its linear and norm layers stay transformers' own."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .. import kernels
from ..models.adapters import MoeLayer
from . import attention, experts
from .config import EngineConfig
from .decoder import Decoder, bf16_gemm_is_fast, packed_bf16_linears_pay
from .deepseek import MlaDecoder
from .step import TORCH_OPS, NativeOps, PagedKV, Routing, Step, experts_read_buffer, read_experts, running

DEFAULT_KV_CAP_BYTES = 512 * 2**20   # default pool cap when neither num_kv_blocks nor memory_budget is given


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (what the weights cost in memory)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


NATIVE_ROUTER_DTYPES = (torch.float32, torch.bfloat16)   # bf16 logits are selected over as fp32, as stock routers do


def native_router(layer: MoeLayer) -> bool:
    """Whether engine decode steps route this layer natively (logits through the step's linear op,
    selection through ``softmax_topk``): softmax scoring (then top-k, renormalised or not) over a
    plain fp32 or bf16 [E, H] weight with no bias, H in 16-wide vectors. DeepSeek's grouped sigmoid
    routing keeps torch's ops."""
    w = getattr(layer.router, "weight", None)
    return (layer.semantics.scoring == "softmax" and layer.router_bias is None
            and getattr(layer.router, "bias", None) is None and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype in NATIVE_ROUTER_DTYPES and w.is_contiguous() and w.shape[1] % 16 == 0)


@dataclass(frozen=True)
class StepOutput:
    """What one forward produced."""
    logits: torch.Tensor                # [B, V] float32 (prompt logprobs: [K, V], the kept rows)
    experts_read: dict[int, int]        # MoE layer -> distinct experts read
    expert_bytes: int                   # expert weight bytes read


def default_max_model_len(model_config) -> int:
    """The context an engine gets when none is asked for: the model's positions, at most 4096 (the
    KV pool is sized from it). ``eval`` checks its prompts against the same number before loading."""
    return min(int(getattr(model_config, "max_position_embeddings", 4096) or 4096), 4096)


class ModelRunner:
    def __init__(self, model, controller, config: EngineConfig, owns_model: bool = False):
        """``controller``: the model's ``routing.controller.RoutingController`` (installed by the caller,
        before this: it names each experts module's layer, which the decode copies below read)."""
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        attention.install(model)
        self.controller = controller
        self.grouped_experts = config.experts_impl == "grouped"
        native = config.native_kernels and self.device.type == "cpu"
        self.native_experts = kernels.swiglu_experts() if native else None
        self.native_attention = kernels.paged_decode_attention() if native else None
        # narrow experts (a split checkpoint's sub-experts) widened with zero neurons for the native kernel
        self.padded = self._pad_experts(owns_model) if self.native_experts is not None else {}
        for layer in self.controller.layers:           # which experts and routers the native ops run (layout, once)
            experts.INSTALLED[layer.experts].native = experts.native_layout(layer.experts) or layer.index in self.padded
        controller.native_routers = frozenset(l.index for l in controller.layers if native_router(l))
        self.native_router = kernels.softmax_topk() if native else None
        # the decoders' linear and norm ops (transformers' modules keep torch's)
        self.native_linear = kernels.rows_linear() if native and kernels.rows_linear_pays() else None
        bf16_gemm_is_fast()   # asked now, so that a decode step only reads the answer
        self.native_norm = kernels.rms_norm() if native else None
        self.decode_ops = NativeOps(router=self.native_router is not None, norm=self.native_norm is not None,
                                    linear=self.native_linear is not None)   # what decode steps run natively
        self.packs = False    # whether the engine packs weights for the native ops (``_expert_weights``)
        # a 4-D attention mask tells transformers the mask is built (engine steps need none: paged
        # attention reads the step context), so it skips mask preparation in every step
        self._mask_built = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self._kv_buffers: dict = {}     # decode gather buffers, reused by every layer and step
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0)) or \
            max(l.index for l in self.controller.layers) + 1
        limit = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        if config.max_model_len is None:
            config.max_model_len = default_max_model_len(model.config)
        elif config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}")
        self._check_attention()
        self.kv_shapes = self._probe_kv_shapes()          # layer -> ((nKV, Dk), (nKV, Dv), native kernel applies)
        # after the probe, which runs the module path on the model's own layout
        self.expert_weights = self._expert_weights(owns_model)   # is_prefill -> layer -> (gate_up, down) | None
        self.expert_bytes = {phase: {l.index: experts.expert_bytes(*(weights or {}).get(l.index, (
            l.experts.gate_up_proj, l.experts.down_proj))) for l in self.controller.layers}
            for phase, weights in self.expert_weights.items()}   # is_prefill -> layer -> bytes
        if self.kv_dtype not in (torch.float32, torch.bfloat16) or not all(ok for *_, ok in self.kv_shapes.values()):
            self.native_attention = None                  # the kernel covers plain attention over fp32 / bf16 caches
        self.block_bytes = config.block_size * sum(
            (k[0] * k[1] + v[0] * v[1]) for k, v, _ in self.kv_shapes.values()) * self.kv_dtype.itemsize
        self.weight_bytes = model_bytes(model)
        self.num_blocks = self._num_blocks()
        self.kv_cache = self._allocate()
        self._compiled = torch.compile(model, dynamic=True) if config.compile_decode else None   # decode steps
        own = config.own_decoder and self._compiled is None
        # dense weights the decoders read packed (copies: the model's modules keep theirs), where the engine packs
        pack = (torch.float32,) + ((torch.bfloat16,) if packed_bf16_linears_pay() else ()) \
            if self.packs and self.native_linear is not None else ()
        self.decoder = Decoder.build(model, self.controller, self.native_attention,
                                     kernels.rotary_kv_write() if self.native_attention is not None else None,
                                     kernels.add_rms_norm() if self.native_attention is not None else None,
                                     config.max_model_len,
                                     kernels.decode_graph() if self.native_attention is not None else None,
                                     self.kv_cache, config.block_size, self.expert_weights[False],
                                     pack, self.native_linear is not None) if own else None
        if self.decoder is None and own:
            self.decoder = MlaDecoder.build(model, self.controller, config.max_model_len, pack)

    def _pad_experts(self, owns_model: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Experts whose width is not a multiple of the native kernel's vector (``experts.pad_width``), padded:
        in place where the engine may change the model's layout (it loaded the model, or was asked to pack
        it), returning {}; else MoE layer -> padded copies (gate_up, down) the engine's steps read instead,
        so a model handed in keeps its own weights (the copies cost the experts' bytes x I'/I)."""
        in_place = owns_model or bool(self.config.pack_weights)
        copies = {}
        for layer in self.controller.layers:
            m = layer.experts
            if not experts.needs_padding(m):
                continue
            gate_up, down = experts.pad_width(m.gate_up_proj.detach(), m.down_proj.detach())
            if in_place:
                m.gate_up_proj, m.down_proj = (torch.nn.Parameter(w, requires_grad=False) for w in (gate_up, down))
            else:
                copies[layer.index] = (gate_up, down)
        return copies

    def _expert_weights(self, owns_model: bool) -> dict[bool, dict | None]:
        """Per phase (is_prefill), MoE layer -> the (gate_up, down) its steps' experts read instead of
        the module's (None = the module's for every layer): decode copies in ``decode_expert_dtype``,
        and the experts packed for the native kernel (``EngineConfig.pack_weights``), in place, one
        layer at a time, so memory does not grow (the decoders then pack their dense weights too)."""
        from ..models.adapters import moe_layers

        c = self.config
        layers = moe_layers(self.model)
        already = any(kernels.is_packed(l.experts.gate_up_proj) for l in layers)   # by an earlier engine

        def row_major(w: torch.Tensor) -> torch.Tensor:
            return kernels.unpack_weight(w) if kernels.is_packed(w) else w.detach()

        def own(l) -> tuple[torch.Tensor, torch.Tensor]:   # the layer's weights: padded copies, else the module's
            return self.padded.get(l.index) or (l.experts.gate_up_proj, l.experts.down_proj)

        decode = None
        if c.decode_expert_dtype is not None and any(l.experts.gate_up_proj.dtype != c.decode_expert_dtype for l in layers):
            decode = {l.index: tuple(row_major(w).to(c.decode_expert_dtype) for w in own(l)) for l in layers}
        pack = already or (c.pack_weights if c.pack_weights is not None else owns_model and kernels.packed_weights_pay())
        if not pack or self.native_experts is None:
            padded = dict(self.padded) or None   # without them (or in place): the module's
            return {True: padded, False: decode if decode is not None else padded}
        packed = {}
        for l in self.controller.layers:
            m = l.experts
            if experts.runs_natively(m):   # the module holds the packed weights from now on
                if not kernels.is_packed(m.gate_up_proj):
                    m.gate_up_proj, m.down_proj = (torch.nn.Parameter(kernels.pack_weight(w.detach()),
                                                                      requires_grad=False) for w in (m.gate_up_proj, m.down_proj))
                packed[l.index] = (m.gate_up_proj, m.down_proj)
        if decode is not None:
            decode = {i: tuple(map(kernels.pack_weight, decode[i])) if i in packed else decode[i] for i in decode}
        self.packs = True
        return {True: packed, False: packed if decode is None else decode}

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
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        native = self.native_experts is not None   # a model an earlier engine packed runs only there
        step = Step(is_prefill=True, probe=probe, experts="native" if native else "loop",
                    experts_read=experts_read_buffer(self.num_layers, self.device) if native else None,
                    expert_weights=self.padded or None)
        with torch.inference_mode(), running(step):
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

    def prepare_prefill(self, seqs: list, block_manager, routing: Routing) -> tuple[torch.Tensor, Step]:
        """Inputs [3, T] (ids, positions, slots: every prompt back to back) and the step."""
        ids, positions, slots, cu = [], [], [], [0]
        for seq in seqs:
            n = len(seq)
            ids += seq.token_ids
            positions += range(n)
            slots += block_manager.slots(seq, 0, n)
            cu.append(cu[-1] + n)
        packed = self._tensor([ids, positions, slots])                               # [3, T]
        kv = PagedKV(self.kv_cache, packed[2], self.config.block_size, cu_seqlens=tuple(cu))
        return packed, self._step(True, routing, kv)

    def prepare_decode(self, seqs: list, block_manager, routing: Routing) -> tuple[torch.Tensor, Step]:
        """Inputs [3, B] (ids, positions, slots) and the step: each sequence's block table [B, nb] and
        cached length [B], which attention reads the cache through (in place with the native kernel;
        else through the gather slots worked out here, once per step)."""
        bs, B = self.config.block_size, len(seqs)
        lens = [len(seq) for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        positions = [n - 1 for n in lens]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        width = max(map(len, tables))
        flat = self._tensor([seq.token_ids[-1] for seq in seqs] + positions + slots + lens   # one host copy a step
                            + [b for t in tables for b in t + [0] * (width - len(t))])
        packed = flat[:4 * B].view(4, B)                                                   # [4, B]
        table = flat[4 * B:].view(B, width)                                                # [B, nb]
        gather = {}
        if self.native_attention is None:
            kv_slots, kv_mask = attention.gather_slots(table, lens, bs)
            num = kv_slots.numel() if isinstance(kv_slots, torch.Tensor) else 0
            gather = dict(kv_slots=kv_slots, kv_mask=kv_mask,
                          gather=attention.gather_buffers(self.kv_cache, num, self._kv_buffers) if num else None)
        kv = PagedKV(self.kv_cache, packed[2], bs, block_table=table, context_lens=packed[3], kv_len=max(lens),
                     native=self.native_attention is not None, **gather)
        return packed[:3], self._step(False, routing, kv)

    def _step(self, is_prefill: bool, routing: Routing, kv: PagedKV) -> Step:
        native = self.native_experts is not None
        return Step(is_prefill, routing, kv,
                    experts="native" if native else "grouped" if self.grouped_experts else "loop",
                    expert_weights=self.expert_weights[is_prefill],
                    native=TORCH_OPS if is_prefill else self.decode_ops,
                    experts_read=experts_read_buffer(self.num_layers, self.device))

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, seqs: list, is_prefill: bool, block_manager, routing: Routing,
            every_position: list[bool] | None = None) -> StepOutput:
        """One forward over the step's sequences under ``routing`` (the phase's compiled policy and
        the per-token budgets). In a prefill step, ``every_position[i]`` keeps all of sequence i's
        rows instead of its last one (prompt logprobs): then the logits are [sum of kept rows, V],
        in sequence order."""
        prepare = self.prepare_prefill if is_prefill else self.prepare_decode
        packed, step = prepare(seqs, block_manager, routing)
        keep = 0
        if is_prefill:
            every = every_position or [False] * len(seqs)
            cu = step.kv.cu_seqlens
            keep = self._tensor([p for i, all_rows in enumerate(every)
                                 for p in (range(cu[i], cu[i + 1]) if all_rows else [cu[i + 1] - 1])])  # [K]
        cast = self.config.prefill_dtype if is_prefill else None
        cast = cast if cast is not None and cast != self.config.dtype else None
        autocast = torch.autocast(self.device.type, dtype=cast) if cast is not None else nullcontext()
        own = self.decoder is not None and cast is None and not self.decoder.hooked()   # else transformers' modules
        with running(step), autocast:
            if own and is_prefill:
                logits = self.decoder.prefill(packed[0], packed[1], step, self.controller, keep)   # [K, V]
            elif own:
                logits = self.decoder.forward(packed[0], packed[1], step, self.controller)  # [B, V]
            else:
                forward = self.model if is_prefill or self._compiled is None else self._compiled
                logits = forward(input_ids=packed[0][None], position_ids=packed[1][None],   # [1, T] each
                                 attention_mask=self._mask_built, use_cache=False, logits_to_keep=keep).logits[0]
        read = read_experts(step)
        per_expert = self.expert_bytes[is_prefill]
        return StepOutput(logits.float(), read, sum(n * per_expert[layer] for layer, n in read.items()))
