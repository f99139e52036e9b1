"""Adapters on tiny random models of every supported architecture."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from moetailor.models import describe, moe_layers
from moetailor.models.architectures import UnsupportedArchitecture, arch_spec
from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model
from moetailor.routing import LayerPolicy, PhasePolicy, RoutingController
from moetailor.runtime.step import read_experts

IDS = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def sliced_model(model, keep):
    """An independent oracle: a stock model of the same architecture holding only ``keep`` experts,
    built by slicing the state dict (routing excludes the other experts by construction)."""
    spec = arch_spec(model.config)
    config = type(model.config).from_dict(model.config.to_dict())
    setattr(config, spec.experts_key, len(keep))
    small = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    idx = torch.tensor(keep)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("mlp.gate.weight", "gate_up_proj", "down_proj", "e_score_correction_bias")) and \
                "shared" not in name and tensor.shape[0] == spec.num_experts(model.config):
            tensor = tensor[idx]
        state[name] = tensor
    small.load_state_dict(state)
    return small


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_masking_equals_model_without_the_experts(arch):
    model = tiny_model(arch)
    keep = [0, 2, 3, 5, 6]
    expected = logits(sliced_model(model, keep))
    ctl = RoutingController(model)
    layers = [l.index for l in ctl.layers]
    with ctl.policy(PhasePolicy.uniform(layers, LayerPolicy(keep=tuple(keep)))):
        masked = logits(model)
    assert (masked - expected).abs().max() < 1e-5
    # a wrong mask must fail the same check
    with ctl.policy(PhasePolicy.uniform(layers, LayerPolicy(keep=(0, 1, 3, 5, 6)))):
        wrong = logits(model)
    assert (wrong - expected).abs().max() > 1e-3


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_identity_policy_reproduces_stock_model(arch):
    model = tiny_model(arch)
    reference = logits(model)
    ctl = RoutingController(model)
    layers = [l.index for l in ctl.layers]
    assert (logits(model) - reference).abs().max() < 1e-5
    # explicit k' = k and beta = 0 run the policy path, and still reproduce the model
    with ctl.policy(PhasePolicy.uniform(layers, LayerPolicy(top_k=model.config.num_experts_per_tok, skip_beta=0.0))):
        assert (logits(model) - reference).abs().max() < 1e-5


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_top_k_change_takes_effect_and_matches_a_config_with_that_k(arch):
    model = tiny_model(arch, top_k=3)
    config = type(model.config).from_dict(model.config.to_dict())
    config.num_experts_per_tok = 1
    stock_k1 = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stock_k1.load_state_dict(model.state_dict())
    ctl = RoutingController(model)
    seen = {}
    with ctl.policy(PhasePolicy.uniform([l.index for l in ctl.layers], LayerPolicy(top_k=1))):
        with ctl.observing(lambda layer, h, z, w, i: seen.__setitem__(layer.index, i.shape[-1])):
            out = logits(model)
    assert set(seen.values()) == {1}
    assert (out - logits(stock_k1)).abs().max() < 1e-5
    assert (out - logits(tiny_model(arch, top_k=3))).abs().max() > 1e-3


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_observation_sees_every_layer_with_consistent_routes(arch):
    model = tiny_model(arch, layers=3)
    ctl = RoutingController(model)
    seen = []

    def observer(layer, hidden, router_logits, weights, index):
        T = IDS.numel()
        assert hidden.shape == (T, model.config.hidden_size)
        assert router_logits.shape == (T, layer.num_experts)
        assert weights.shape == index.shape == (T, layer.top_k)
        seen.append(layer.index)

    with ctl.observing(observer), ctl.policy(None) as step:
        logits(model)
    assert seen == [0, 1, 2]
    assert set(read_experts(step)) == {0, 1, 2}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_expert_forward_matches_the_experts_module(arch):
    model = tiny_model(arch)
    layer = moe_layers(model)[0]
    h = torch.randn(5, model.config.hidden_size)
    index = torch.full((5, layer.top_k), layer.num_experts)  # all sentinels ...
    index[:, 0] = 3                                           # ... but expert 3 at weight 1
    weights = torch.zeros(5, layer.top_k)
    weights[:, 0] = 1.0
    RoutingController(model)
    with torch.no_grad():
        assert torch.allclose(layer.experts(h, index, weights), layer.expert_forward(3, h), atol=1e-6)


def test_describe_reports_shape_and_gating():
    facts = describe(tiny_model("qwen2_moe", num_experts=8, top_k=2, layers=2))
    assert facts["routed_experts_per_layer"] == 8 and facts["top_k"] == 2 and facts["layers"] == 2
    assert "renormalised" in facts["gate_normalisation"] and "sigmoid-gated" in facts["shared_expert"]
    assert facts["parameters_active_per_token"] < facts["parameters_total"]
    olmoe = describe(tiny_model("olmoe"))
    assert "no renormalisation" in olmoe["gate_normalisation"] and olmoe["shared_expert"] == "none"


def test_unknown_architecture_names_the_supported_ones():
    from transformers import LlamaConfig
    with pytest.raises(UnsupportedArchitecture, match="qwen2_moe.*deepseek_v3"):
        arch_spec(LlamaConfig())


def test_policy_validation_errors_are_clear():
    model = tiny_model("qwen2_moe", top_k=2)
    ctl = RoutingController(model)
    layers = [l.index for l in ctl.layers]
    with pytest.raises(ValueError, match="fewer than top-k"):
        ctl.compile(PhasePolicy.uniform(layers, LayerPolicy(keep=(1,))))
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, 2\]"):
        ctl.compile(PhasePolicy.uniform(layers, LayerPolicy(top_k=5)))
    with pytest.raises(ValueError, match="not MoE layers"):
        ctl.compile(PhasePolicy({7: LayerPolicy(top_k=1)}))
    with pytest.raises(ValueError, match="fold statistics"):
        ctl.compile(PhasePolicy.uniform(layers, LayerPolicy(keep=(0, 1, 2), pool_mode="fold")))
