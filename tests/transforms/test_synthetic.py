import json

import pytest
import torch

from moetailor.transforms.synthetic import PRESETS, hub_tensors, synthetic_config, write_synthetic

SMALL = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             vocab_size=8192, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=16)


def small(preset):
    keys = synthetic_config(preset).to_dict()
    return {k: v for k, v in SMALL.items() if k in keys and (k != "head_dim" or preset.startswith("qwen3"))}


@pytest.mark.parametrize("preset,params", [("olmoe-1b-7b", 6.92e9), ("qwen3-30b-a3b", 30.5e9),
                                           ("qwen1.5-moe-a2.7b", 14.3e9), ("mixtral-8x7b", 46.7e9),
                                           ("deepseek-v2-lite", 15.7e9)])
def test_presets_have_the_published_parameter_counts(preset, params):
    n = sum(torch.Size(s).numel() for _, s in hub_tensors(synthetic_config(preset)))
    assert abs(n - params) / params < 0.01


@pytest.mark.parametrize("preset", list(PRESETS))
def test_synthetic_checkpoint_is_sharded_and_loads_in_stock_transformers(tmp_path, preset):
    from transformers import AutoModelForCausalLM

    out = write_synthetic(preset, tmp_path / "m", layers=2, shard_bytes=300_000, progress=False, **small(preset))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert any(".experts.1." in k for k in index["weight_map"])          # hub layout: one tensor per expert
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.isfinite(model(ids).logits).all()


def test_synthetic_weights_are_seeded(tmp_path):
    from safetensors.torch import load_file

    a = write_synthetic("olmoe-1b-7b", tmp_path / "a", layers=1, seed=3, progress=False, **small("olmoe-1b-7b"))
    b = write_synthetic("olmoe-1b-7b", tmp_path / "b", layers=1, seed=3, progress=False, **small("olmoe-1b-7b"))
    c = write_synthetic("olmoe-1b-7b", tmp_path / "c", layers=1, seed=4, progress=False, **small("olmoe-1b-7b"))
    ta, tb, tc = (load_file(str(next(p.glob("*.safetensors")))) for p in (a, b, c))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.layers.0.mlp.gate.weight"], tc["model.layers.0.mlp.gate.weight"])


def test_routers_are_skewed_towards_a_few_hot_experts(tmp_path):
    """The first layer's top-1 choice over the whole vocabulary: with skew the hottest experts take a
    far larger share than 1/E; without it the share is near uniform."""
    from transformers import AutoModelForCausalLM

    shares = {}
    for skew in (0.0, 1.5):
        out = write_synthetic("olmoe-1b-7b", tmp_path / f"s{skew}", layers=1, skew=skew, progress=False,
                              **small("olmoe-1b-7b"))
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        layer = model.model.layers[0]
        x = layer.post_attention_layernorm(model.model.embed_tokens.weight)      # [V, H]
        top1 = layer.mlp.gate.weight.mul(1).matmul(x.T).argmax(0)                  # [V]
        counts = torch.bincount(top1, minlength=64).float()
        shares[skew] = float(counts.topk(4).values.sum() / counts.sum())
    print(shares)
    assert shares[1.5] > 2 * shares[0.0]


def test_synth_cli_refuses_an_existing_directory(tmp_path):
    from moetailor.cli.main import main

    (tmp_path / "x").mkdir()
    assert main(["synth", "olmoe-1b-7b", "--out", str(tmp_path / "x"), "--layers", "1"]) == 2



@pytest.mark.parametrize("skew,min_used,max_hottest", [(0.0, 56, 0.4), (1.0, 40, 0.97)])
def test_routing_stays_token_dependent_through_the_layers(tmp_path, skew, min_used, max_hottest):
    """Held-out text through a 4-layer model: without skew, routing is near uniform in every layer (an
    expert is in a token's top 8 for 1/8 of tokens on average); with skew, most experts are still used.
    Random attention at N(0, 0.02) once added a vector common to all tokens, 30x the embeddings' norm,
    so every token picked the same experts (hottest expert 98-100% of tokens, 23-29 of 64 used)."""
    from transformers import AutoModelForCausalLM

    from moetailor.data.corpus import bundled_documents
    from moetailor.eval.metrics import heldout_windows
    from moetailor.models.loading import load_tokenizer

    out = write_synthetic("olmoe-1b-7b", tmp_path / "m", layers=4, skew=skew, progress=False, hidden_size=512,
                          intermediate_size=64, vocab_size=8192, num_attention_heads=8, num_key_value_heads=8)
    windows = heldout_windows(load_tokenizer(out), bundled_documents("heldout"), 1, 128)[:4]     # [4, 128]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor(windows), output_router_logits=True).router_logits   # L x [T, E]
    for layer, lg in enumerate(logits):
        top = lg.topk(8, dim=-1).indices                                               # [T, 8]
        counts = torch.bincount(top.flatten(), minlength=64)
        used, hottest = int((counts > 0).sum()), float(counts.max() / top.shape[0])
        assert used >= min_used and hottest < max_hottest, (layer, used, hottest)
