"""A synthetic bandwidth-bound MoE: stock OLMoE config with OLMoE-1B-7B layer shapes, random weights.

Decode on it is bound by expert-weight reads, as on a real model, but it needs no download: hidden
2048, 64 experts of width 1024, top-8 (each expert 3*2048*1024 fp32 = 25 MB, 1.6 GB per layer), so
two MoE layers already hold 3.2 GB of experts, ten times the 300 MiB L3 cache. Vocabulary and
layer count are small so the experts dominate the bytes a step reads.
"""
from __future__ import annotations

import torch

from ..transforms.synthetic import PRESETS

_OLMOE = PRESETS["olmoe-1b-7b"]     # the published shapes; `moetailor synth` writes the full-depth checkpoint
HIDDEN, EXPERTS, EXPERT_WIDTH, TOP_K = (_OLMOE["hidden_size"], _OLMOE["num_experts"], _OLMOE["intermediate_size"],
                                        _OLMOE["num_experts_per_tok"])


def synthetic_config(layers: int = 2, vocab: int = 1024, hidden: int = HIDDEN, experts: int = EXPERTS,
                     expert_width: int = EXPERT_WIDTH, top_k: int = TOP_K):
    from transformers import OlmoeConfig

    if layers < 1:
        raise ValueError(f"the synthetic model needs at least one MoE layer (got {layers})")
    return OlmoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_width, num_experts=experts,
                       num_experts_per_tok=top_k, num_hidden_layers=layers, num_attention_heads=16,
                       num_key_value_heads=16, max_position_embeddings=4096, norm_topk_prob=False,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=1)


def synthetic_model(layers: int = 2, seed: int = 0, vocab: int = 1024, **shape):
    """The seeded random model in eval mode, fp32 (the fast decode path on CPU), built in memory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(synthetic_config(layers, vocab, **shape), dtype=torch.float32)
    model.eval()
    model.moetailor_source = f"synthetic-olmoe-{layers}-layers-seed{seed}"
    return model
