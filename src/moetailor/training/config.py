"""The reference models' shapes as stock transformers configs: ``qwen2_moe`` (the bundled ``reference``:
64 fine experts, top-8, a sigmoid-gated shared expert) and ``qwen3_moe`` (``reference-qwen3``: 64
experts, top-8, no shared expert, q/k norms), trained on the same corpus and tasks (``models.paths``).
"""
from __future__ import annotations

from ..tables import unknown_choice

FAMILIES = ("qwen2_moe", "qwen3_moe")


def model_config(vocab_size: int, family: str = "qwen2_moe"):
    """The config of one family's reference model; ``family`` is one of ``FAMILIES``."""
    common = dict(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024, rope_theta=10000.0,
                  tie_word_embeddings=True, output_router_logits=False, router_aux_loss_coef=0.01,
                  bos_token_id=None, eos_token_id=0, pad_token_id=1)
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(intermediate_size=1024, moe_intermediate_size=48, shared_expert_intermediate_size=256,
                              **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # No shared expert: the routed experts are a little wider (64 against 48) so the active
        # FFN width per token (8 x 64 = 512) stays near the first model's (8 x 48 + 256 = 640).
        return Qwen3MoeConfig(intermediate_size=1024, moe_intermediate_size=64, head_dim=64, **common)
    raise ValueError(unknown_choice("reference family", family, FAMILIES))


def model_class(family: str):
    """The transformers class that trains ``family``."""
    from transformers import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    classes = {"qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}
    if family not in classes:
        raise ValueError(unknown_choice("reference family", family, FAMILIES))
    return classes[family]
