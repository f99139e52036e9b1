"""Merged-expert plans: HC-SMoE clustering, M-SMoE dominant assignment, frequency weights, the plan
format, and the router refusing to apply a merge to the original experts."""
import pytest
import torch

from moetailor.calibration import ExpertStats, calibrate_batches
from moetailor.models.adapters import moe_layers, semantics_for
from moetailor.models.architectures import arch_spec
from moetailor.models.tiny import tiny_model
from moetailor.plans.criteria import make_plan, super_experts
from moetailor.plans.merging import average_linkage, dominant_assignment, weighted_groups
from moetailor.plans.plan import Plan
from moetailor.routing.policy import LayerPolicy
from moetailor.routing.router import CompiledPolicy


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    g = torch.Generator().manual_seed(0)
    stats = calibrate_batches(model, [torch.randint(0, 96, (4, 16), generator=g) for _ in range(3)], progress=False)
    return model, stats, stats.save(tmp_path_factory.mktemp("stats") / "stats.safetensors")


def test_average_linkage_finds_separated_clusters():
    g = torch.Generator().manual_seed(1)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    members = [0, 1, 2, 0, 1, 2, 2, 0]            # expert -> blob
    features = centres[members] + 0.1 * torch.randn(8, 2, generator=g)
    assert average_linkage(features, 3) == [[0, 3, 7], [1, 4], [2, 5, 6]]
    assert average_linkage(features, 8) == [[e] for e in range(8)]
    assert sorted(map(len, average_linkage(features, 2))) == [3, 5]   # two blobs join, none splits
    with pytest.raises(ValueError):
        average_linkage(features, 0)


def test_dominant_assignment_joins_the_most_similar_dominant():
    sim = torch.eye(5)
    sim[1, 3], sim[2, 0], sim[4, 3] = 0.9, 0.8, 0.7
    assert dominant_assignment(sim, [3, 0]) == [[0, 2], [3, 1, 4]]


def test_weights_follow_routing_frequency_and_the_most_frequent_member_represents():
    groups = weighted_groups([[0, 1], [2], [3, 4]], torch.tensor([1.0, 3.0, 5.0, 0.0, 0.0]))
    assert groups == (((1, 0.75), (0, 0.25)), ((2, 1.0),), ((3, 0.5), (4, 0.5)))   # never routed: uniform


@pytest.mark.parametrize("method", ["hcsmoe", "msmoe"])
def test_merge_plans_partition_every_layer_and_round_trip(calibrated, tmp_path, method):
    model, stats, path = calibrated
    plan = make_plan(stats, model, "frequency", keep=0.5, merge=method, stats_path=str(path))
    E = plan.model["num_experts"]
    for i in plan.model["moe_layers"]:
        p = plan.decode.for_layer(i)
        assert p.merges and len(p.merge) == 4 and p.merge_router == "dominant"
        assert sorted(e for g in p.merge for e, _ in g) == list(range(E))
        assert all(abs(sum(w for _, w in g) - 1) < 1e-6 for g in p.merge)
        freq = stats.layers[i].frequency
        assert all(float(freq[g[0][0]]) == max(float(freq[e]) for e, _ in g) for g in p.merge)
        assert p.keep == tuple(sorted(g[0][0] for g in p.merge))
        assert plan.prefill.for_layer(i).is_identity
    assert plan.merges and plan.meta["merge"]["method"] == method
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").decode == plan.decode
    sem = semantics_for(model.config, arch_spec(model.config))
    with pytest.raises(ValueError, match="merged checkpoint"):
        CompiledPolicy.build(plan.decode.for_layer(plan.model["moe_layers"][0]), sem, "cpu")


def test_msmoe_dominant_experts_are_the_most_frequent(calibrated):
    model, stats, path = calibrated
    plan = make_plan(stats, model, "frequency", keep=0.5, merge="msmoe")
    rows = {layer.index: layer.router.weight.float() for layer in moe_layers(model)}
    for i, layer in stats.layers.items():
        p = plan.decode.for_layer(i)
        top = torch.argsort(-layer.frequency.double(), stable=True)[:4].tolist()
        assert set(p.keep) == set(top)
        unit = torch.nn.functional.normalize(rows[i], dim=-1)
        for g in p.merge:   # every member is closer (router-row cosine) to its own dominant than to another
            for e, _ in g[1:]:
                assert int(p.keep[int(torch.argmax((unit[e] @ unit[list(p.keep)].T)))]) == g[0][0]


def test_protected_super_experts_stay_alone(calibrated):
    model, stats, _ = calibrated
    stats = ExpertStats.load(_)
    layer = next(iter(stats.layers))
    st = stats.layers[layer]
    st.out_max[5] = 1e4 * float(st.out_max.max())
    assert super_experts(stats, 1) == {layer: [5]}
    for method in ("hcsmoe", "msmoe"):
        plan = make_plan(stats, model, "frequency", keep=0.5, merge=method, protect_super=1)
        assert ((5, 1.0),) in plan.decode.for_layer(layer).merge


def test_merge_policy_checks():
    with pytest.raises(ValueError, match="sum to 1"):
        LayerPolicy(keep=(0,), pool_mode="merge", merge=(((0, 0.5), (1, 0.2)),), merge_router="dominant").validate(2, 1)
    with pytest.raises(ValueError, match="more than one place"):
        LayerPolicy(keep=(0, 1), pool_mode="merge", merge=(((0, 1.0),), ((1, 0.5), (0, 0.5))),
                    merge_router="dominant").validate(2, 1)
    with pytest.raises(ValueError, match="go together"):
        LayerPolicy(keep=(0,), pool_mode="merge").validate(2, 1)
    with pytest.raises(ValueError, match="representative"):
        LayerPolicy(keep=(1,), pool_mode="merge", merge=(((0, 0.5), (1, 0.5)),), merge_router="dominant").validate(2, 1)


def test_hcsmoe_uses_every_tokens_outputs_when_calibrated_with_all_experts(tmp_path):
    """`calibrate --all-experts` records each expert's outputs over every token (HC-SMoE's signature),
    saved and read back; the hcsmoe plan then clusters on it and says so."""
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 96, (4, 16), generator=g) for _ in range(2)]
    stats = calibrate_batches(model, batches, all_experts=True, progress=False)
    stats = ExpertStats.load(stats.save(tmp_path / "all.safetensors"))
    layer = next(iter(stats.layers.values()))
    assert layer.has_all_outputs and torch.all(layer.out_all_count == 2 * 4 * 16)
    assert not torch.allclose(layer.mean_output_all, layer.mean_output)        # every token, not the routed ones
    plan = make_plan(stats, model, "frequency", keep=0.5, merge="hcsmoe")
    assert plan.meta["merge"]["signature"] == "mean output over every calibration token"
    routed = calibrate_batches(model, batches, progress=False)
    assert not next(iter(routed.layers.values())).has_all_outputs
    assert make_plan(routed, model, "frequency", keep=0.5, merge="hcsmoe").meta["merge"]["signature"].endswith("routed to the expert")
