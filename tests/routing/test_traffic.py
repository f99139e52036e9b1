"""Traffic accounting on known inputs: the distinct-expert formula, and the experts and bytes a step read."""
import pytest
import torch

from moetailor.routing.traffic import expected_distinct


def test_formula_known_values():
    assert expected_distinct(64, 8, 0) == 0
    assert expected_distinct(64, 8, 1) == pytest.approx(8.0)          # one token reads exactly k experts
    assert expected_distinct(64, 8, 2) == pytest.approx(64 * (1 - (56 / 64) ** 2))  # 15.0
    assert expected_distinct(64, 8, 2) == pytest.approx(15.0)
    assert expected_distinct(8, 8, 5) == pytest.approx(8.0)           # k = m: every expert, every step
    # SlimWise: m=256, k=8, B=64 reads about 87% of the pool
    assert expected_distinct(256, 8, 64) / 256 == pytest.approx(1 - (1 - 8 / 256) ** 64)
    assert 0.86 < expected_distinct(256, 8, 64) / 256 < 0.88


def test_formula_monotone_and_bounded():
    values = [expected_distinct(64, 8, b) for b in range(0, 200)]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert values[-1] < 64


def test_formula_rejects_bad_inputs():
    with pytest.raises(ValueError, match="top_k"):
        expected_distinct(4, 8, 1)
    with pytest.raises(ValueError, match="batch"):
        expected_distinct(64, 8, -1)


def test_formula_matches_uniform_simulation():
    g = torch.Generator().manual_seed(0)
    m, k, B = 64, 8, 16
    counts = [torch.stack([torch.randperm(m, generator=g)[:k] for _ in range(B)]).unique().numel()  # [B, k]
              for _ in range(400)]
    assert sum(counts) / len(counts) == pytest.approx(expected_distinct(m, k, B), rel=0.02)


class RouteCounter:
    """Observer for ``RoutingController.observing``: distinct real experts per layer of the last forward."""

    def __init__(self) -> None:
        self.distinct: dict[int, int] = {}

    def __call__(self, layer, hidden, logits, weights, index) -> None:
        flat = index.reshape(-1)                                             # [T*K], E = dropped route
        self.distinct[layer.index] = int(flat[flat < layer.num_experts].unique().numel())


def test_route_counter_and_meter_agree_on_tiny_model():
    from moetailor.models import moe_layers
    from moetailor.models.tiny import tiny_model
    from moetailor.routing import LayerPolicy, PhasePolicy, RoutingController
    from moetailor.runtime.step import read_experts

    model = tiny_model("qwen3_moe", num_experts=8, top_k=2)
    ctl = RoutingController(model)
    counter = RouteCounter()
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    layers = moe_layers(model)
    keep = PhasePolicy.uniform([l.index for l in layers], LayerPolicy(keep=(0, 1, 2)))
    with torch.no_grad(), ctl.observing(counter), ctl.policy(keep) as step:
        model(ids)
    assert set(counter.distinct) == {l.index for l in layers}
    assert all(1 <= v <= 3 for v in counter.distinct.values())       # masked to 3 experts
    assert counter.distinct == read_experts(step)
    assert layers[0].expert_bytes() == 3 * 32 * 16 * 4                  # gate+up+down, H=32, I=16, fp32
