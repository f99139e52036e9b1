"""Criteria scores on hand-made statistics, budgets, plans and their errors."""
import pytest
import torch

from moetailor.calibration import ExpertStats, LayerStats, StatsMismatch, calibrate_batches
from moetailor.models.loading import model_fingerprint
from moetailor.models.tiny import tiny_model
from moetailor.plans import Plan
from moetailor.plans.criteria import CRITERIA, expert_scores, layer_budgets, make_plan, parse_layer_budgets


def hand_stats(model) -> ExpertStats:
    """Two layers of 8 experts with chosen sums: each criterion ranks the experts differently."""
    fp = model_fingerprint(model)
    layers = {}
    for i in fp["moe_layers"]:
        st = LayerStats.zeros(8, fold=False)
        st.frequency[:] = torch.tensor([10, 0, 40, 30, 20, 5, 25, 15], dtype=torch.float64)
        st.mass[:] = torch.tensor([9, 0, 10, 12, 3, 5, 11, 1], dtype=torch.float64)
        st.ean[:] = torch.tensor([50, 0, 80, 20, 90, 10, 30, 40], dtype=torch.float64)
        st.weighted_ean[:] = torch.tensor([30, 0, 8, 9, 10, 6, 1, 12], dtype=torch.float64)
        layers[i] = st
    return ExpertStats({"model": fp, "tokens": 100, "data": "hand", "gate": {"name": "renorm"}}, layers)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", num_experts=8, top_k=2)


def test_scores_and_kept_experts(model):
    stats = hand_stats(model)
    expected = {  # keep 4 of 8
        "frequency": (2, 3, 4, 6),
        "mass": (0, 2, 3, 6),
        "ean": (0, 2, 4, 7),
        "weighted-ean": (0, 3, 4, 7),
        "reap": (0, 5, 4, 7),   # 30/10=3, 6/5=1.2, 10/20=0.5, 12/15=0.8 beat 8/40, 9/30, 1/25, 0
        "structured-even": (0, 2, 4, 6),
        "structured-first": (0, 1, 2, 3),
    }
    for criterion, keep in expected.items():
        plan = make_plan(stats, model, criterion, keep=0.5)
        assert set(plan.kept_experts("decode").values()) == {tuple(sorted(keep))}, criterion
        assert plan.prefill.is_identity  # decode phase by default
        assert plan.meta["criterion"] == criterion
    reap = expert_scores(stats, "reap")[0]
    torch.testing.assert_close(reap, torch.tensor([3, 0, .2, .3, .5, 1.2, .04, .8], dtype=torch.float64))
    # random is seeded, differs by seed and by layer, and keeps the requested count
    a, b = make_plan(stats, model, "random", keep_experts=3, seed=1), make_plan(stats, model, "random", keep_experts=3, seed=1)
    assert a.decode == b.decode and all(len(k) == 3 for k in a.kept_experts().values())
    scores = [expert_scores(stats, "random", seed=s) for s in (1, 2)]
    assert not torch.equal(scores[0][0], scores[1][0]) and not torch.equal(scores[0][0], scores[0][1])
    assert set(CRITERIA) >= set(expected) | {"random"}


def test_ties_go_to_the_lower_id(model):
    stats = hand_stats(model)
    for st in stats.layers.values():
        st.frequency[:] = torch.tensor([5, 7, 7, 7, 1, 7, 0, 2], dtype=torch.float64)
    plan = make_plan(stats, model, "frequency", keep_experts=3)
    assert plan.kept_experts()[0] == (1, 2, 3)


def test_per_layer_budgets_and_phases(model, tmp_path):
    stats = hand_stats(model)
    assert parse_layer_budgets("0:6,1:4", [0, 1]) == {0: 6, 1: 4}
    assert parse_layer_budgets("0-1:3", [0, 1]) == {0: 3, 1: 3}
    assert parse_layer_budgets("[5, 2]", [0, 1]) == {0: 5, 1: 2}
    plan = make_plan(stats, model, "frequency", layers="0:6,1:3", phase="both")
    assert {i: len(k) for i, k in plan.kept_experts("decode").items()} == {0: 6, 1: 3}
    assert plan.prefill == plan.decode
    # --layers overrides the uniform budget where it names a layer
    plan = make_plan(stats, model, "mass", keep=0.5, layers="1:2", phase="prefill")
    assert {i: len(k) for i, k in plan.kept_experts("prefill").items()} == {0: 4, 1: 2}
    assert plan.decode.is_identity
    path = plan.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back == plan
    back.check_model(model)
    assert layer_budgets(stats.model, keep=0.3) == {0: 2, 1: 2}  # round(0.3 * 8)


def test_bad_budgets(model):
    stats = hand_stats(model)
    with pytest.raises(ValueError, match="fewer than top-k=2.*k fixed"):
        make_plan(stats, model, "reap", keep_experts=1)
    with pytest.raises(ValueError, match="fewer than top-k"):
        make_plan(stats, model, "reap", layers="1:1")
    with pytest.raises(ValueError, match="only 8"):
        make_plan(stats, model, "reap", keep_experts=9)
    with pytest.raises(ValueError, match="unknown criterion 'soft-count'; choose from: frequency, mass"):
        make_plan(stats, model, "soft-count", keep=0.5)
    with pytest.raises(ValueError, match="not both"):
        make_plan(stats, model, "reap", keep=0.5, keep_experts=4)
    with pytest.raises(ValueError, match="give a budget"):
        make_plan(stats, model, "reap")
    with pytest.raises(ValueError, match=r"ratio in \(0, 1\]"):
        make_plan(stats, model, "reap", keep=50)
    with pytest.raises(ValueError, match="2 MoE layers"):
        make_plan(stats, model, "reap", layers="[4, 4, 4]")
    with pytest.raises(ValueError, match="not a MoE layer"):
        make_plan(stats, model, "reap", layers="0-5:4")
    with pytest.raises(ValueError, match="LAYER:COUNT"):
        make_plan(stats, model, "reap", layers="first:4")
    with pytest.raises(ValueError, match="unknown phase"):
        make_plan(stats, model, "reap", keep=0.5, phase="both-ways")


def test_stats_from_another_model(model):
    stats = calibrate_batches(model, [torch.randint(0, 96, (2, 8))], progress=False)
    make_plan(stats, model, "reap", keep=0.5)
    with pytest.raises(StatsMismatch, match="router_hash"):
        make_plan(stats, tiny_model("qwen3_moe", seed=5, num_experts=8, top_k=2), "reap", keep=0.5)
    with pytest.raises(StatsMismatch, match="num_experts"):
        make_plan(stats, tiny_model("qwen3_moe", num_experts=16, top_k=2), "reap", keep=0.5)
    plan = make_plan(stats, model, "reap", keep=0.5)
    with pytest.raises(ValueError, match="does not match the model"):
        plan.check_model(tiny_model("qwen3_moe", num_experts=8, top_k=4))


def test_bundled_plans_carry_no_machine_path_and_say_what_they_were_calibrated_on():
    import json
    from pathlib import Path

    import moetailor
    plans = sorted((Path(moetailor.__file__).parent / "assets" / "plans").glob("*.json"))
    assert plans
    for path in plans:
        data = json.loads(path.read_text())
        assert data["model"]["source"] == "reference", path
        assert "/work/" not in path.read_text() and not str(data["meta"].get("stats", "")).startswith("/")
        calibration = data["meta"]["calibration"]
        assert calibration["data"] == "tasks" and calibration["tokens"] > 0 and len(calibration["sha256"]) == 16


def test_info_on_a_plan_shows_its_calibration(tmp_path, capsys):
    from moetailor.calibration import calibrate
    from moetailor.cli.main import main
    from moetailor.models.tiny import char_tokenizer, tiny_model
    from moetailor.plans.criteria import make_plan

    model = tiny_model("qwen2_moe")
    stats = calibrate(model, char_tokenizer(), "tasks:sorting", 256, batch_tokens=128, seq_len=64, progress=False)
    make_plan(stats, model, "reap", keep=0.5).save(tmp_path / "p.json")
    assert main(["info", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert f"tasks:sorting (256 tokens, sha256 {stats.meta['data_sha256']})" in out and "reap" in out
    assert main(["info", str(tmp_path / "missing.json")]) == 2


def test_router_only_statistics_refuse_the_norm_criteria(model):
    """Statistics observed on an engine whose experts kernel gives no per-route output (vLLM's fused
    MoE) hold frequency and mass only: the criteria that read output norms refuse them by name, the
    router criteria plan from them."""
    from moetailor.calibration.calibrate import Collector, stats_of
    from moetailor.routing import RoutingController

    ctl = RoutingController.of(model)
    collector = Collector(ctl.layers, outputs=False)
    try:
        with torch.no_grad(), ctl.policy(None), ctl.observing(collector):
            model(torch.randint(0, model.config.vocab_size, (2, 16)))
    finally:
        ctl.remove()
    stats = stats_of(collector, model_fingerprint(model), 32, False, 0.0,
                     {"observed": {"expert_outputs": "none: the kernel returns only the weighted sum"}})
    assert not stats.has_expert_norms and not stats.has_outputs
    for layer in stats.layers.values():
        assert layer.frequency.sum() == 32 * model.config.num_experts_per_tok and layer.ean.sum() == 0
    for criterion in ("ean", "weighted-ean", "reap"):
        with pytest.raises(ValueError, match=f"criterion {criterion} needs expert output norms.*weighted sum"):
            expert_scores(stats, criterion)
    assert expert_scores(stats, "frequency").keys() == stats.layers.keys()
