"""The engine's decoder for Qwen-MoE-style checkpoints: one definition that runs prefill and
decode steps alike (gpt-fast's shape: the layer written out, shapes beside each line).

Why: at batch 1 a decode step is almost all fixed cost. Through transformers' modules it is ~110
module calls and ~50 small ops per layer; here it is the same arithmetic written out. ``prefill``
runs transformers' decoder layer op for op over every prompt token of the step (its projections one
by one, so its GEMMs are transformers'), writing the new k/v into the paged pool
(``attention.prefill_attention``, the one prefill attention of the engine). ``forward`` is a decode
step: pre-norm, one stacked q|k|v projection, the rotary embedding and the new k/v written into the
paged pool in one native op (``rotary_kv_write``, equal to the model's rotary bit for bit) and
attended over in place, and one stacked gate|up projection for the shared expert. Both run the MoE
block through the same routing controller and experts implementation every other path uses (so
plans, budgets, observers and the experts-read count are unchanged). A prefill under an autocast
(``EngineConfig.prefill_dtype``) runs transformers' modules, as do calibration and evaluation, which
hook them (observers on every router, forward hooks on modules).

With the native ops and at most ``NATIVE_LINEAR_ROWS`` rows the loop runs in C++ (the same ops in
the same order, ``kernels/decode_layer.cpp``): a whole full-router step is one call of the
``DecodeGraph`` bound at start-up (``BoundGraph``), a layer one call of its bound layer, or under a
plan, budgets or observers its ``attention`` + the controller's routing + its ``moe``.

Covered (``Decoder.build`` returns None otherwise, and the engine keeps transformers' modules):
``qwen2_moe``, ``qwen3_moe``, ``olmoe`` and ``mixtral`` checkpoints in fp32 or bf16, with the native
experts and attention kernels, every layer a full-attention MoE layer, every projection one the native
linear op takes (``runs_native``). Each projection runs ``module_linear`` (packed, the op; else
``native_linear``'s choice of the op or torch's GEMM); without the native linear and norm ops the
decoder is transformers' arithmetic bit for bit (``rotary_kv_write`` and ``add_rms_norm`` round as
torch's bf16 ops). The native layer ops and the bound graph take bf16 too, converting where the Python
loop converts (a bf16 shared expert through its own projections, not rows of ``moe_in``): on tiny bf16
models a batch-1 step is half the Python loop's, on a real-size OLMoE ~4% less. The stacked
projections are copies of the dense (non-expert) weights (attention and shared expert; packed where the
engine packs, ``engine_weight``), a few percent of a MoE checkpoint's bytes. A model with forward hooks
on any module (``hooked``) runs the module path, so the hooks see every step.

The native linear and RMSNorm ops (``native_linear``, ``rms_norm``) live here because only the
engine's decoders call them; transformers' modules stay stock and keep torch's ops.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import kernels
from ..models.adapters import MoeLayer, decoder_layers, moe_layers
from . import attention
from .experts import experts_forward, layer_of, native_experts_forward, novice_split, runs_natively
from .step import Step, current

FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
DTYPES = (torch.float32, torch.bfloat16)
# Qwen-MoE's fp32 decoder stacks its router and shared expert into one row-major ``moe_in`` and reads
# its projections row-major; the others' fp32 projections are packed where the engine packs (real-size
# 2048-wide layers: the packed op 1.2-4.6x torch's fp32 GEMM at 1-512 rows)
ROW_MAJOR_FP32 = ("qwen2_moe", "qwen3_moe")


NATIVE_LINEAR_ROWS = 8   # up to this many rows a linear layer runs the native op (a decode step's GEMV); else torch's GEMM
NATIVE_LINEAR_DTYPES = (torch.float32, torch.bfloat16)   # the weights the op reads (activations in fp32)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: in an engine decode step of at most ``NATIVE_LINEAR_ROWS`` rows,
    the native op, which streams the [N, H] weight once (2x faster on the reference model's 256-wide
    projections at batch 1); else torch's. A bf16 layer takes its rows in fp32 and rounds the fp32
    sums to bf16 once, as torch's bf16 GEMM does; where that GEMM has no hardware kernels (no
    AVX512-BF16 or AMX: widened in software, 2-3x slower than the op) every decode step's bf16 layer runs the
    op, whatever its rows."""
    step = current()
    rows = x.numel() // x.shape[-1]
    if step is None or not step.native.linear or x.dtype != weight.dtype or x.dtype not in NATIVE_LINEAR_DTYPES \
            or (rows > NATIVE_LINEAR_ROWS and not (x.dtype == torch.bfloat16 and not bf16_gemm_is_fast())):
        return torch.nn.functional.linear(x, weight, bias)
    if x.dtype == torch.bfloat16:   # the op widens the rows and rounds its fp32 sums (+ bias) to bf16 once, as below
        return torch.ops.moetailor.rows_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight,
                                               bias).view(*x.shape[:-1], -1)
    fused = bias is not None and bias.dtype == torch.float32                           # the op adds an fp32 bias
    y = torch.ops.moetailor.rows_linear(x.reshape(rows, x.shape[-1]).float().contiguous(), weight,  # [rows, N] fp32
                                        bias if fused else None)
    if bias is not None and not fused:
        y = y + bias
    return y.to(x.dtype).view(*x.shape[:-1], -1)                                        # [..., N]


_BF16_GEMM_FAST: list[bool] = []   # asked once (a module global: torch.compile reads it without a graph break)


def bf16_gemm_is_fast() -> bool:
    """Whether torch's bf16 GEMM has bf16 hardware under it (``kernels.cpu_has_bf16_matmul``); without,
    a bf16 layer's rows stay on the native op, 2-3x faster. The runner asks before any step, so a
    compiled decode step only reads the answer."""
    if not _BF16_GEMM_FAST:
        _BF16_GEMM_FAST.append(kernels.cpu_has_bf16_matmul())
    return _BF16_GEMM_FAST[0]


def packed_bf16_linears_pay() -> bool:
    """Whether an engine packs its bf16 linear layers for the native op, which then takes every row of
    them: where torch's bf16 GEMM widens in software (``bf16_gemm_is_fast`` false; the op 2-3x faster),
    or where the op has the bf16 dot product itself (``kernels.experts_round_to_bf16``). There the packed
    op beats oneDNN's AVX512-BF16 GEMM at the rows a decode step has (1.3-4.4x at 1-32 rows) and is level
    at 128 (docs/benchmarks.md, "Linear layers"); only a 512-row LM head is slower, and a prefill takes
    the head on each sequence's last token only."""
    return not bf16_gemm_is_fast() or kernels.experts_round_to_bf16()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel) -> torch.Tensor:
    """transformers' RMSNorm of ``x`` (fp32, or bf16 with fp32 inside): one call of the native
    ``kernel``, or op for op without one."""
    if kernel is None:
        f = x.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def runs_native(weight: torch.Tensor) -> bool:
    """Whether the native linear op takes ``weight``: packed, or a contiguous fp32 / bf16 [N, K] whose
    input size is whole 16-wide vectors."""
    return kernels.is_packed(weight) or (weight.dtype in NATIVE_LINEAR_DTYPES and weight.is_contiguous()
                                         and weight.shape[-1] % 16 == 0)


def engine_weight(weight: torch.Tensor, pack: tuple = ()) -> torch.Tensor:
    """The copy of a dense weight an engine decoder reads: packed for the op's panel tile where its
    dtype is in ``pack`` and its sizes allow (``kernels.pack_weight``), else the weight itself. The
    model's own layer keeps its layout, so transformers' modules still run it."""
    weight = weight.detach()
    if weight.dtype in pack and not kernels.is_packed(weight) and weight.dim() == 2 and weight.is_contiguous() \
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
        return kernels.pack_weight(weight)
    return weight


STATIC_ROPE = ("default", "linear", "llama3", "yarn")   # rope types whose cos/sin depend on the position only


def module_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: a weight the engine packed on the native op (rows in the weight's dtype,
    the result in ``x``'s), any other through ``native_linear`` (in a decode step the op up to
    ``NATIVE_LINEAR_ROWS`` rows, else torch's GEMM, transformers' own arithmetic)."""
    if weight.dim() == 4:   # packed (``kernels.pack_weight``: a linear weight is [N, K] else)
        return torch.ops.moetailor.rows_linear(x.to(weight.dtype).contiguous(), weight, bias).to(x.dtype)
    return native_linear(x, weight, bias)


def novice_routes(layer: MoeLayer, step: Step, weights: torch.Tensor, index: torch.Tensor):
    """(constant [T, H] or None, weights, index): ``experts.novice_split`` where the step's plan for the
    layer replaces dropped experts by their constants; any other layer's routes as they are."""
    cp = step.routing.policy.get(layer.index)
    if cp is None or cp.constants is None:
        return None, weights, index
    return novice_split(cp, weights, index)


def rotary_table(rotary: torch.nn.Module, like: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin [positions, D] from the model's own rotary module, computed once for every position
    (the same elementwise arithmetic as per step), or None for a rope that depends on the sequence
    (dynamic, longrope: transformers recomputes its frequencies as the sequence grows)."""
    kind = getattr(rotary, "rope_type", None) or "default"
    if positions <= 0 or kind not in STATIC_ROPE:
        return None
    with torch.inference_mode():
        cos, sin = rotary(like[:1], torch.arange(positions, device=like.device)[None])   # [1, P, D] each
    return cos[0], sin[0]


def model_hooks(model) -> tuple[dict, ...]:
    """Every module's forward (pre-)hook dicts, for ``hooked``."""
    return tuple(d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks))


def hooked(hooks: tuple[dict, ...], own: int) -> bool:
    """Whether a forward (pre-)hook besides the routing controller's ``own`` is registered on the model
    (``hooks``: ``model_hooks``) or globally: the step then runs transformers' modules, which call them."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return sum(map(len, hooks)) > own   # registering a hook adds to these dicts in place: one C-level pass a step


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor   # [D]
    eps: float

    @classmethod
    def of(cls, module) -> "Norm":
        return cls(module.weight, float(module.variance_epsilon))

    def __call__(self, x: torch.Tensor, kernel) -> torch.Tensor:
        """The RMSNorm: the step's native op (decode steps), else transformers' arithmetic op for op."""
        return rms_norm(x, self.weight, self.eps, kernel)

    def heads(self, t: torch.Tensor, kernel) -> torch.Tensor:
        """q or k [B, n, D] through a q/k norm: per head where it holds D weights (qwen3_moe), else over
        each token's whole n x D projection (olmoe, which norms before splitting heads)."""
        if self.weight.numel() == t.shape[-1]:
            return self(t, kernel)
        return self(t.reshape(t.shape[0], -1), kernel).view(t.shape)

    def after_add(self, x: torch.Tensor, residual: torch.Tensor, kernel, add_kernel) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): the residual add and the next norm, in one native call
        where the step has the norm op (the same bits: ``add_rms_norm``)."""
        if kernel is not None and add_kernel is not None:
            return add_kernel(x, residual, self.weight, self.eps)
        x = x + residual
        return x, rms_norm(x, self.weight, self.eps, kernel)


@dataclass(frozen=True)
class DecoderLayer:
    index: int
    input_norm: Norm
    post_norm: Norm
    qkv: torch.Tensor                 # [(nH + 2 nKV) D, H]: q, k, v projections stacked (a packed copy where the engine packs)
    qkv_bias: torch.Tensor | None     # [(nH + 2 nKV) D]
    q_norm: Norm | None               # qwen3_moe: per-head RMSNorm of q and k; olmoe: over all heads
    k_norm: Norm | None
    o: torch.Tensor                   # [H, nH D]
    moe: MoeLayer
    moe_in: torch.Tensor              # [E (+ 2 I + 1), H]: router | shared expert gate, up | its sigmoid gate,
                                      # stacked (fp32; bf16: the router's weight alone), the native layer ops read it
    shared: torch.Tensor | None       # [2 I, H]: shared expert gate and up projections (fp32: a view of moe_in)
    shared_gate: torch.Tensor | None  # [1, H]: the shared expert's sigmoid gate (fp32: a view of moe_in)
    shared_down: torch.Tensor | None  # [H, I]
    # the layer's own weights, unstacked (prefill steps run each projection as transformers does):
    # (weight, bias) of q, k, v; the shared expert's gate, up and sigmoid gate weights
    projections: tuple = ()
    shared_own: tuple | None = None

    @property
    def unstacked_shared(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate|up, sigmoid gate) weights the native layer ops project the shared expert with: bf16
        ones (not rows of ``moe_in``, whose layout may differ: packed or not), else (None, None)."""
        if self.shared is None or self.moe_in.dtype == torch.float32:
            return None, None
        return self.shared, self.shared_gate


@dataclass(frozen=True)
class BoundGraph:
    """The native ``DecodeGraph`` of an engine decoder: its layers' weights, the runner's KV cache and
    decode expert copies bound once, so a step passes only its own inputs: the whole step in one call
    (``op.forward``) or one bound layer (``op.layer``, ``op.attention`` / ``op.moe``)."""
    op: object                        # torch.classes.moetailor.DecodeGraph
    kv_cache: list                    # what it was bound to: a step that brings others runs the Python loop
    block_size: int
    expert_weights: dict | None
    whole_step: bool                  # every router selects natively: a full-router step is one call

    @classmethod
    def build(cls, decoder: "Decoder", graph_class, kv_cache: list, block_size: int,
              expert_weights: dict | None, whole_step: bool) -> "BoundGraph":
        cos, sin = decoder.rotary_table
        op = graph_class(decoder.embed, decoder.layers[0].input_norm.weight, decoder.layers[0].input_norm.eps,
                         decoder.lm_head, cos, sin, decoder.heads, decoder.kv_heads, block_size, decoder.scaling)
        norms = [layer.input_norm for layer in decoder.layers[1:]] + [decoder.final_norm]
        for layer, next_norm in zip(decoder.layers, norms):
            moe = layer.moe
            gate_up, down = (expert_weights or {}).get(moe.index) or (moe.experts.gate_up_proj, moe.experts.down_proj)
            qk = (None, None, 0.0) if layer.q_norm is None else (layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps)
            op.add_layer(layer.qkv, layer.qkv_bias, *qk, *kv_cache[layer.index], layer.o, layer.post_norm.weight,
                         layer.post_norm.eps, layer.moe_in, moe.top_k, moe.semantics.normalise, gate_up, down,
                         layer_of(moe.experts), moe.num_experts, layer.shared_down,
                         *layer.unstacked_shared, next_norm.weight, next_norm.eps, decoder.round_weights)
        return cls(op, kv_cache, block_size, expert_weights, whole_step)

    def binds(self, step: Step) -> bool:
        """Whether ``step`` reads the cache and expert weights the graph was bound to."""
        return (step.kv.cache is self.kv_cache and step.kv.block_size == self.block_size
                and step.expert_weights is self.expert_weights)

    def runs(self, step: Step, controller) -> bool:
        """Whether ``step`` runs as one call: every layer under the full router (no plan, no budgets, no
        observers) on what the graph was bound to."""
        return (self.whole_step and controller.routes_every_layer_in_full(step) and not controller.observers
                and self.binds(step))


@dataclass(frozen=True)
class Decoder:
    layers: tuple[DecoderLayer, ...]
    embed: torch.Tensor               # [V, H]
    final_norm: Norm
    lm_head: torch.Tensor             # [V, H]
    rotary: torch.nn.Module           # the model's rotary embedding (cos, sin for positions)
    rotary_table: tuple[torch.Tensor, torch.Tensor] | None   # its cos, sin [max_model_len, D] worked out once (static rope)
    apply_rotary: object              # the model's apply_rotary_pos_emb
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    hooks: tuple[dict, ...]                # every module's forward (pre-)hook dicts, for ``hooked``
    own_hooks: int                         # how many of them are the routing controller's
    rotary_kv: object = None               # the native rotary + k/v write op, else the model's rotary and two copies
    add_norm: object = None                # the native residual add + RMSNorm op, else an add and the norm
    graph: "BoundGraph | None" = None      # the native decode step (kernels/decode_layer.cpp), or None
    round_weights: bool = False            # the stock router returns bf16 weights (all but Mixtral): the native ops too

    @classmethod
    def build(cls, model, controller, attention_kernel, rotary_kernel=None, add_norm_kernel=None,
              max_model_len: int = 0, graph_class=None, kv_cache: list | None = None, block_size: int = 0,
              expert_weights: dict | None = None, pack: tuple = (), native_linear: bool = False) -> "Decoder | None":
        """The engine decoder of ``model``, or None where it does not apply (see the module doc). ``pack``:
        the dtypes whose dense weights it reads packed (copies); ``native_linear``: decode steps run the
        native linear op, which then must take every projection (``runs_native``)."""
        cfg = model.config
        if cfg.model_type not in FAMILIES or attention_kernel is None or getattr(cfg, "clip_qkv", None) is not None:
            return None
        inner = model.model
        head = model.get_output_embeddings()
        dtype = head.weight.dtype
        if dtype not in DTYPES or getattr(head, "bias", None) is not None:
            return None
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return None
        if cfg.model_type in ROW_MAJOR_FP32:
            pack = tuple(d for d in pack if d != torch.float32)
        moe = {layer.index: layer for layer in moe_layers(model)}
        layers = []
        for index, block in enumerate(decoder_layers(model)):
            attn = block.self_attn
            if index not in moe or not runs_natively(block.mlp.experts):
                return None                                                   # dense layers: module path
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            layer = moe[index]
            mlp = layer.shared_expert
            dense = [*projections, attn.o_proj, head] + ([] if mlp is None else
                                                         [mlp.gate_proj, mlp.up_proj, mlp.down_proj, layer.shared_gate])
            if native_linear and not all(runs_native(m.weight) for m in dense):
                return None                                                   # a size the op does not take
            biases = [p.bias for p in projections]
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            qkv = engine_weight(torch.cat([p.weight for p in projections]).contiguous(), pack)
            shared = shared_gate = shared_down = None
            moe_in = layer.router.weight.detach()
            if mlp is not None:
                E, I = moe_in.shape[0], mlp.gate_proj.out_features
                if dtype == torch.float32 and dtype not in pack:
                    moe_in = torch.cat([moe_in, mlp.gate_proj.weight, mlp.up_proj.weight, layer.shared_gate.weight]).detach()
                    shared, shared_gate = moe_in[E:E + 2 * I], moe_in[E + 2 * I:]   # row ranges: contiguous views
                else:
                    shared = engine_weight(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), pack)
                    shared_gate = layer.shared_gate.weight.detach()
                shared_down = engine_weight(mlp.down_proj.weight, pack)
            stacked = kernels.is_packed(qkv)   # packed copies: prefill reads the stacked ones too
            layers.append(DecoderLayer(
                index, Norm.of(block.input_layernorm), Norm.of(block.post_attention_layernorm),
                qkv, torch.cat(biases).detach() if all(b is not None for b in biases) else None,
                Norm.of(q_norm) if q_norm is not None else None, Norm.of(k_norm) if k_norm is not None else None,
                engine_weight(attn.o_proj.weight, pack), layer, moe_in, shared, shared_gate, shared_down,
                () if stacked else tuple((p.weight.detach(), None if p.bias is None else p.bias.detach())
                                         for p in projections),
                None if mlp is None or stacked else tuple(
                    m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, layer.shared_gate))))
        if any(t.dtype != dtype for l in layers for t in (l.qkv, l.o, l.moe_in)):
            return None
        tied = head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()   # the embedding reads it row-major
        attn = decoder_layers(model)[0].self_attn
        fusable = all(l.qkv.is_contiguous() and l.o.is_contiguous() and (l.q_norm is None or l.q_norm.eps == l.k_norm.eps)
                      and (l.shared_down is None or l.shared_down.is_contiguous()) for l in layers)
        decoder = cls(tuple(layers), inner.embed_tokens.weight, Norm.of(inner.norm),
                      head.weight.detach() if tied else engine_weight(head.weight, pack), inner.rotary_emb,
                      rotary_table(inner.rotary_emb, inner.embed_tokens.weight, max_model_len),
                      sys.modules[type(attn).__module__].apply_rotary_pos_emb, cfg.num_attention_heads,
                      cfg.num_key_value_heads, attn.head_dim, float(attn.scaling),
                      model_hooks(model), len(controller.hooks),
                      rotary_kernel, add_norm_kernel, round_weights=controller.spec.cast_weights_to_logits_dtype)
        if not fusable or None in (graph_class, rotary_kernel, add_norm_kernel, decoder.rotary_table, kv_cache):
            return decoder
        whole_step = all(l.moe.index in controller.native_routers for l in layers)
        return replace(decoder, graph=BoundGraph.build(decoder, graph_class, kv_cache, block_size, expert_weights,
                                                       whole_step))

    def hooked(self) -> bool:
        return hooked(self.hooks, self.own_hooks)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: Step, controller) -> torch.Tensor:
        """One decode step: ids [B], positions [B] -> logits [B, V]. Runs inside ``running(step)``
        (the router and experts read it); writes each layer's new k/v at ``step.kv.slot_mapping``.
        Each projection runs ``module_linear`` (up to ``NATIVE_LINEAR_ROWS`` rows or packed the native
        op, else torch's GEMM; stacking rows of a weight changes no column of either). Each residual add is fused with the norm after it (the
        next layer's, or the final one)."""
        norm, kv = torch.ops.moetailor.rms_norm if step.native.norm else None, step.kv   # the norm op the Norms run
        native_rows = step.native.linear and ids.shape[0] <= NATIVE_LINEAR_ROWS   # the native layer ops' condition
        if self.graph is not None and native_rows and norm is not None and self.graph.runs(step, controller):
            budget = step.routing.k_max if step.routing.token_top_k is not None else 0   # 0: each layer's own k
            return self.graph.op.forward(ids, positions, kv.slot_mapping, kv.block_table, kv.context_lens,
                                         step.experts_read, int(budget))     # [B, V]: what follows, in one call
        B, nH, nKV, D = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)                                      # [B, H] the residual stream
        if self.rotary_table is not None:
            cos, sin = (t[positions][None] for t in self.rotary_table)        # [1, B, D] each
        else:
            cos, sin = self.rotary(x, positions[None])                        # [1, B, D] each
        h = self.layers[0].input_norm(x, norm)                                # [B, H]
        if self.graph is not None and native_rows and norm is not None and self.graph.binds(step):
            for i, layer in enumerate(self.layers):                           # a native call or three a layer
                x, h = self.native_layer(i, layer, x, h, cos[0], sin[0], step, controller)  # [B, H] each
            return module_linear(h, self.lm_head)                             # [B, V]
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        for layer, next_norm in zip(self.layers, next_norms):
            qkv = module_linear(h, layer.qkv, layer.qkv_bias).view(B, nH + 2 * nKV, D)   # [B, nH + 2 nKV, D]
            q, k, v = torch.split_with_sizes(qkv, (nH, nKV, nKV), dim=1)      # [B, nH | nKV | nKV, D] views
            if layer.q_norm is not None:
                q, k = layer.q_norm.heads(q, norm), layer.k_norm.heads(k, norm)
            k_cache, v_cache = kv.cache[layer.index]                          # [slots, nKV, D]
            if self.rotary_kv is not None:                                    # one op: rotary, k/v written
                q = self.rotary_kv(q, k, v, cos[0], sin[0], k_cache, v_cache, kv.slot_mapping)  # [B, nH, D]
            else:
                q, k = self.apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)  # [1, n, B, D]
                k_cache.index_copy_(0, kv.slot_mapping, k[0].transpose(0, 1).to(k_cache.dtype))
                v_cache.index_copy_(0, kv.slot_mapping, v.to(v_cache.dtype))
                q = q[0].transpose(0, 1).contiguous()                         # [B, nH, D]
            o = torch.ops.moetailor.paged_decode_attention(q.float(), k_cache, v_cache, kv.block_table, kv.context_lens,
                                                           kv.block_size, self.scaling).to(x.dtype)   # [B, nH, D]: fp32 inside
            x, h = layer.post_norm.after_add(x, module_linear(o.reshape(B, nH * D), layer.o), norm,
                                             self.add_norm)                         # [B, H] each
            x, h = next_norm.after_add(x, self.moe(layer, h, controller, step), norm, self.add_norm)
        return module_linear(h, self.lm_head)                                 # [B, V]

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, step: Step, controller,
                keep: torch.Tensor) -> torch.Tensor:
        """One prefill step: ids [T], positions [T] (every prompt back to back) -> logits [K, V] of the
        rows ``keep`` [K]. transformers' decoder layer op for op (its projections one by one, its norms,
        rotary, attention through ``attention.prefill_attention``, the MoE block through the routing
        controller and the step's experts path), so it equals the module path bit for bit where its
        weights are the model's own (packed copies: the stacked q|k|v and gate|up on the op); without
        the decode step's native linear and norm ops, which a prefill step does not use."""
        T, nH, nKV, D = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)                                      # [T, H] the residual stream
        if self.rotary_table is not None:
            cos, sin = (t[positions][None] for t in self.rotary_table)        # [1, T, D] each
        else:
            cos, sin = self.rotary(x, positions[None])                        # [1, T, D] each
        for layer in self.layers:
            h = layer.input_norm(x, None)                                     # [T, H]
            if layer.projections:                                             # [T, nH D | nKV D | nKV D]
                q, k, v = (module_linear(h, w, b) for w, b in layer.projections)
            else:                                                             # packed: the stacked copy
                q, k, v = module_linear(h, layer.qkv, layer.qkv_bias).split((nH * D, nKV * D, nKV * D), dim=-1)
            if layer.q_norm is not None:
                q, k = layer.q_norm.heads(q.view(T, nH, D), None), layer.k_norm.heads(k.view(T, nKV, D), None)
            q, k, v = (t.reshape(1, T, -1, D).transpose(1, 2) for t in (q, k, v))   # [1, n, T, D]
            q, k = self.apply_rotary(q, k, cos, sin)                          # [1, n, T, D]
            o = attention.prefill_attention(q, k, v, step.kv, layer.index, self.scaling)   # [1, T, nH, D]
            x = x + module_linear(o.reshape(T, nH * D), layer.o)             # [T, H]
            h = layer.post_norm(x, None)
            x = x + self.moe_prefill(layer, h, controller, step)              # [T, H]
        return module_linear(self.final_norm(x, None)[keep], self.lm_head)   # [K, V]

    @staticmethod
    def moe_prefill(layer: DecoderLayer, h: torch.Tensor, controller, step: Step) -> torch.Tensor:
        """The sparse MoE block of a prefill step: the routed experts through the step's experts path
        (``experts_forward``, as transformers' block calls its experts module), plus the sigmoid-gated
        shared expert from its own three projections."""
        _, weights, index = controller.route_layer(layer.moe, h)                     # [T, K] each
        out = experts_forward(layer.moe.experts, h, index, weights)                  # [T, H]
        if layer.shared is None:
            return out
        if layer.shared_own is not None:
            gate_w, up_w, shared_gate = layer.shared_own
            gate, up = module_linear(h, gate_w), module_linear(h, up_w)              # [T, I] each
        else:                                                                          # packed: the stacked copy
            (gate, up), shared_gate = module_linear(h, layer.shared).chunk(2, dim=-1), layer.shared_gate
        shared = module_linear(F.silu(gate) * up, layer.shared_down)                  # [T, H]
        return out + torch.sigmoid(module_linear(h, shared_gate)) * shared

    def native_layer(self, i: int, layer: DecoderLayer, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, step: Step, controller) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` through the bound graph's layer ops, the same arithmetic as ``forward``'s Python loop
        op for op: one ``layer`` call under the full router, else ``attention``, the controller's routing
        of the layer's logits (plans, budgets, observers), then ``moe``."""
        kv, moe, graph = step.kv, layer.moe, self.graph.op
        if controller.selects_natively(moe, step) and not controller.observers:
            budget = step.routing.k_max if step.routing.token_top_k is not None else 0   # 0: the layer's own k
            return graph.layer(i, x, h, cos, sin, kv.slot_mapping, kv.block_table, kv.context_lens,
                               step.experts_read, int(budget))               # [B, H] each
        x, h, moe_in_out = graph.attention(i, x, h, cos, sin, kv.slot_mapping, kv.block_table,
                                           kv.context_lens)                   # [B, H] x2, [B, E (+ 2I + 1)]
        _, weights, index = controller.route_layer(moe, h, logits=moe_in_out[:, :moe.semantics.num_experts])  # [B, K]
        constant, weights, index = novice_routes(moe, step, weights, index)
        if constant is not None:   # novice experts' g * c_e joins the residual the block adds the experts to
            x = x + constant.to(x.dtype)
        return graph.moe(i, x, h, index.long().contiguous(), weights.float().contiguous(), step.experts_read,
                         moe_in_out)                                          # [B, H] each

    @staticmethod
    def moe(layer: DecoderLayer, h: torch.Tensor, controller, step: Step) -> torch.Tensor:
        """The sparse MoE block: routed experts (+ the sigmoid-gated shared expert). The experts run
        the module path's native call directly (not through the module and transformers' dispatch)."""
        _, weights, index = controller.route_layer(layer.moe, h)                   # [B, K] each
        constant, weights, index = novice_routes(layer.moe, step, weights, index)
        out = native_experts_forward(layer.moe.experts, h, index, weights, step)   # [B, H]
        if constant is not None:
            out = out + constant.to(out.dtype)
        if layer.shared is None:
            return out
        gate, up = module_linear(h, layer.shared).chunk(2, dim=-1)            # [B, I] each
        shared = module_linear(F.silu(gate) * up, layer.shared_down)          # [B, H]
        return out + torch.sigmoid(module_linear(h, layer.shared_gate)) * shared
