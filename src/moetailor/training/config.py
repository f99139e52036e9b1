"""The reference model's shape: a stock Qwen2-MoE config (used by the recipe and the diagnostics)."""
from __future__ import annotations


def model_config(vocab_size: int):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=1024, moe_intermediate_size=48, shared_expert_intermediate_size=256,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True, output_router_logits=False,
        router_aux_loss_coef=0.01, bos_token_id=None, eos_token_id=0, pad_token_id=1,
    )
