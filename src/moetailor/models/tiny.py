"""Tiny random-weight models of every supported architecture, built in code (tests, benchmarks)."""
from __future__ import annotations

import torch

from ..tables import unknown_choice

TINY_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v3")


def tiny_config(model_type: str, num_experts: int = 8, top_k: int = 2, layers: int = 2, hidden: int = 32,
                expert_width: int = 16, vocab: int = 96, **overrides):
    """A small stock config of ``model_type`` (all layers sparse)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=top_k,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=1)
    if model_type == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, num_experts=num_experts, moe_intermediate_size=expert_width,
                                shared_expert_intermediate_size=2 * expert_width, intermediate_size=4 * hidden,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif model_type == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_experts=num_experts, moe_intermediate_size=expert_width,
                                intermediate_size=4 * hidden, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[], head_dim=hidden // 4)
    elif model_type == "olmoe":
        cfg = tf.OlmoeConfig(**common, num_experts=num_experts, intermediate_size=expert_width, norm_topk_prob=False)
    elif model_type == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=num_experts, intermediate_size=expert_width)
    elif model_type == "deepseek_v3":
        common["num_key_value_heads"] = 4  # MLA: one kv head per query head
        cfg = tf.DeepseekV3Config(**common, n_routed_experts=num_experts, moe_intermediate_size=expert_width,
                                  intermediate_size=4 * hidden, n_shared_experts=1, first_k_dense_replace=0,
                                  n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                  q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=8)
    else:
        raise ValueError(unknown_choice("tiny architecture", model_type, TINY_ARCHITECTURES))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(model_type: str, seed: int = 0, **kwargs):
    """A seeded random tiny model in eval mode, fp32. Router weights are scaled up so routing is
    decisive (random init otherwise gives near-uniform logits and fragile top-k ties)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **kwargs), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    model.eval()
    return model


# DeepSeek-V3's routing in miniature: a dense first layer, 16 routed experts in 4 groups, top-4 from the
# best 2 groups, one shared expert, sigmoid scores with a correction bias, routed_scaling_factor 2.5
GROUPED = dict(num_experts=16, top_k=4, layers=3, n_group=4, topk_group=2, first_k_dense_replace=1)


def tiny_grouped_model(seed: int = 0, **kwargs):
    """A tiny DeepSeek-V3-style model with grouped routing (``GROUPED``, overridable)."""
    return tiny_model("deepseek_v3", seed=seed, **{**GROUPED, **kwargs})


def char_tokenizer(vocab: int = 96):
    """One token per character, so a tiny checkpoint directory is complete (text prompts, task prompts,
    calibration text) without a hub: 0 = <eos>, 1 = <pad> (also unknown characters), 2 = newline,
    3.. = printable ASCII from the space on, as many as ``vocab`` holds (98 = all of them; 96, the
    tiny models' default, leaves out "}" and "~")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][: vocab - 3]
    ids = {"<eos>": 0, "<pad>": 1, "\n": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
