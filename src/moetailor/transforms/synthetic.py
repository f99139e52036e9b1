"""Synthetic real-shaped checkpoints: published MoE configs, seeded random bf16 weights, written to disk.

``write_synthetic(preset, out)`` writes what the hub ships (sharded safetensors with an index,
``config.json``, the bundled 8,192-id tokenizer, per-expert layout), so every moetailor verb and stock
transformers load it. Each tensor comes from a generator seeded by (seed, name), written shard by
shard: memory holds one shard (``shard_bytes``), never the model.

Weights: linear N(0, 0.02), norms 1, biases 0. Routers are skewed so a few experts are hot: every
embedding row carries a shared unit direction u (as long as its random part); router row e is a random
row orthogonal to u at unit logit std plus a multiple of u that adds ``skew * b_e`` (b_e ~ N(0, 1)
per layer) to expert e's logit for every token.

Two rules keep routing token-dependent through the layers (without them the hottest expert takes
nearly every token): random attention averages each position's context, which is nearly the same
vector for every token (u and the mean embedding) and at N(0, 0.02) several times the embeddings'
norm. So (1) q, k, v (MLA: q and kv_a) read the residual with u projected out, and (2) the attention
output projection has std 0.02 / sqrt(hidden). docs/scale.md gives the measured expert frequencies.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from ..models.checkpoint import ShardWriter, hub_names, meta_model
from ..tables import unknown_choice

# Published configs (hub config.json values that set shapes and routing).
PRESETS: dict[str, dict] = {
    "olmoe-1b-7b": dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096,
                        rope_theta=10000.0, rms_norm_eps=1e-5, clip_qkv=None),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                              norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                              max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              use_sliding_window=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-5, sliding_window=None),
    # DeepSeek-V2-Lite's shapes (MLA, 2 shared experts, first layer dense) in the DeepSeek-V3 architecture
    # transformers and moetailor support (sigmoid scores; one routing group as in V2-Lite).
    "deepseek-v2-lite": dict(model_type="deepseek_v3", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=False,
                             routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                             qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096,
                             rope_theta=10000.0, rms_norm_eps=1e-6),
}
TOKEN_IDS = dict(bos_token_id=None, eos_token_id=0, pad_token_id=1)   # the bundled tokenizer's
HOT_DIRECTION = 1.0        # |u component| / |random part| of every embedding row
DEFAULT_SKEW = 1.0         # router logit offset scale of the hot direction
INIT_STD = 0.02
# attention projections that read the residual stream (hub names), and the one that writes it back
ATTN_INPUTS = tuple(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"))
ATTN_OUTPUT = "self_attn.o_proj.weight"
SIDECAR = "moetailor_synthetic.json"


def synthetic_config(preset: str, layers: int | None = None, **overrides):
    """The stock transformers config of a preset (``layers``: a depth-reduced copy)."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(unknown_choice("synthetic preset", preset, PRESETS))
    values = {**PRESETS[preset], **TOKEN_IDS, "tie_word_embeddings": False, **overrides}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1 (got {layers})")
        values["num_hidden_layers"] = layers
    model_type = values.pop("model_type")
    rope_theta = values.pop("rope_theta", None)
    config = AutoConfig.for_model(model_type, **values)
    if rope_theta is not None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    config.architectures = [type(meta_model(config, torch.bfloat16)).__name__]
    config.dtype = "bfloat16"
    return config


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


class _Init:
    """Seeded values for one hub tensor, by name (see the module docstring)."""

    def __init__(self, config, seed: int, skew: float):
        H = config.hidden_size
        self.seed, self.skew, self.hidden = seed, skew, H
        u = torch.randn(H, generator=_generator(seed, "hot-direction"))
        self.u = u / u.norm()                                                  # [H] unit
        self.std = float(getattr(config, "initializer_range", INIT_STD) or INIT_STD)

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        g = _generator(self.seed, name)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        if name.endswith("bias"):                                             # qkv biases, e_score_correction_bias
            return torch.zeros(shape, dtype=dtype)
        x = torch.empty(shape, dtype=torch.float32)
        if name.endswith("embed_tokens.weight"):                              # [V, H]
            x.normal_(0.0, self.std, generator=g)
            x += HOT_DIRECTION * self.std * math.sqrt(self.hidden) * self.u
        elif name.endswith(".gate.weight") and len(shape) == 2 and shape[1] == self.hidden and "experts" not in name:
            # router [E, H]: a random part orthogonal to u (unit logit std on the embeddings) plus a
            # per-expert multiple of u (logit offset ~ skew * b_e on the embeddings)
            E, H = shape
            x.normal_(0.0, 1.0, generator=g)
            x -= (x @ self.u)[:, None] * self.u[None, :]
            share = HOT_DIRECTION / math.sqrt(1 + HOT_DIRECTION**2)      # u's share of a normalised row
            x *= 1.0 / (math.sqrt(1 - share**2) * math.sqrt(H))
            b = torch.randn(E, generator=g)                               # [E] per-expert hotness
            x += (self.skew / (share * math.sqrt(H))) * b[:, None] * self.u[None, :]
        elif name.endswith(ATTN_INPUTS) and shape[-1] == self.hidden:     # [out, H]: blind to u
            x.normal_(0.0, self.std, generator=g)
            x -= (x @ self.u)[:, None] * self.u[None, :]
        elif name.endswith(ATTN_OUTPUT):                                       # [H, heads * D]
            x.normal_(0.0, self.std / math.sqrt(self.hidden), generator=g)
        else:
            x.normal_(0.0, self.std, generator=g)
        return x.to(dtype)


def hub_tensors(config) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a hub checkpoint of ``config`` stores, (name, shape), in module order."""
    model = meta_model(config, torch.bfloat16)
    out = []
    tied = getattr(config, "tie_word_embeddings", False)
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        for hub, shape, _ in hub_names(name, tuple(t.shape), config.model_type):
            out.append((hub, tuple(shape)))
    return out


def write_synthetic(preset: str, out: str | Path, *, layers: int | None = None, seed: int = 0,
                    skew: float = DEFAULT_SKEW, shard_bytes: int = 1 << 30, overwrite: bool = False,
                    progress: bool = True, **overrides) -> Path:
    """Write a synthetic checkpoint of ``preset``'s shape to ``out`` (bf16, sharded); returns ``out``."""
    from tqdm import tqdm

    from ..models.loading import REFERENCE_DIR
    from .artifacts import checkpoint_directory, copy_tokenizer

    config = synthetic_config(preset, layers, **overrides)
    dtype = torch.bfloat16
    tensors = hub_tensors(config)
    total = sum(math.prod(s) for _, s in tensors) * dtype.itemsize
    init = _Init(config, seed, skew)
    with checkpoint_directory(Path(out), overwrite) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {preset}", disable=not progress,
                   mininterval=2)
        for name, shape in tensors:
            writer.add(name, init(name, shape, dtype))
            bar.update(math.prod(shape) * dtype.itemsize)
        writer.close()
        bar.close()
        config.save_pretrained(tmp)
        copy_tokenizer(REFERENCE_DIR, tmp)
        params = sum(math.prod(s) for _, s in tensors)
        (tmp / SIDECAR).write_text(json.dumps({
            "format": "moetailor-synthetic", "preset": preset, "layers": config.num_hidden_layers, "seed": seed,
            "skew": skew, "hot_direction": HOT_DIRECTION, "init_std": init.std,
            "attention_init": "q/k/v blind to the hot direction; o_proj std init_std / sqrt(hidden)", "parameters": params,
            "bytes": total, "note": "random weights: task accuracy is meaningless; compare models by held-out KL"},
            indent=1))
    return Path(out)
