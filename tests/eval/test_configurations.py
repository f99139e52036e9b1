import pytest

from moetailor.eval.configurations import CONFIGURATIONS, PHASE_CONFIGURATIONS, ConfigSpec, configuration, parse_configs
from moetailor.models.tiny import tiny_model
from moetailor.plans import PlanMismatch, uniform_plan
from moetailor.routing import FULL_PHASE, LayerPolicy


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_moe", num_experts=8, top_k=2)


def test_four_phase_configurations_from_a_decode_plan(model):
    keep = LayerPolicy(keep=(0, 2, 4, 6))
    plan = uniform_plan(model, decode=keep, criterion="reap", keep_ratio=0.5)
    built = {name: ConfigSpec(name).build(model, plan).plan for name in PHASE_CONFIGURATIONS}
    p = plan.decode
    assert (built["baseline"].prefill, built["baseline"].decode) == (FULL_PHASE, FULL_PHASE)
    assert (built["pruned"].prefill, built["pruned"].decode) == (p, p)
    assert (built["reverse"].prefill, built["reverse"].decode) == (p, FULL_PHASE)
    assert (built["phase-aware"].prefill, built["phase-aware"].decode) == (FULL_PHASE, p)
    assert built["reverse"].meta["configuration"] == "reverse"
    assert built["reverse"].meta["criterion"] == "reap"  # the base plan's provenance is kept


def test_a_prefill_only_plan_prunes_with_its_prefill_policy(model):
    plan = uniform_plan(model, prefill=LayerPolicy(keep=(1, 3, 5)))
    assert plan.pruning_policy() == plan.prefill
    with pytest.raises(ValueError, match="full router in both phases"):
        uniform_plan(model).pruning_policy()


def test_baseline_needs_no_plan_and_the_others_do(model):
    assert ConfigSpec("baseline").build(model, None).plan.decode.is_identity
    with pytest.raises(ValueError, match="needs a plan"):
        ConfigSpec("phase-aware").build(model, None)


def test_plan_for_another_model_is_rejected(model):
    other = tiny_model("qwen2_moe", seed=1, num_experts=8, top_k=2)
    plan = uniform_plan(other, decode=LayerPolicy(keep=(0, 1, 2, 3)))
    with pytest.raises(PlanMismatch, match="router_hash"):
        ConfigSpec("pruned").build(model, plan)


def test_parse_configs_validates_names_and_arguments():
    specs = parse_configs("baseline, phase-aware,topk:1")
    assert [s.label for s in specs] == ["baseline", "phase-aware", "topk:1"]
    with pytest.raises(ValueError, match="unknown configuration 'halfway'; choose from: .*baseline"):
        parse_configs("baseline,halfway")
    with pytest.raises(ValueError, match="needs an argument"):
        parse_configs("topk")
    with pytest.raises(ValueError, match="takes no argument"):
        parse_configs("pruned:3")
    with pytest.raises(ValueError, match="twice"):
        parse_configs("pruned,pruned")


def test_topk_configuration_runs_on_the_model(model):
    plan = parse_configs("topk:1")[0].build(model, None).plan
    assert plan.decode.for_layer(0).top_k == 1 and plan.prefill.for_layer(1).top_k == 1
    with pytest.raises(ValueError, match="top_k=3"):
        parse_configs("topk:3")[0].build(model, None)  # more than the model's k=2


def test_a_new_technique_registers_without_touching_the_runner(model):
    @configuration("test-decode-keep", uses_plan=False, takes_arg=True, help="keep the first N experts in decode")
    def _first_n(model, plan, arg):
        return uniform_plan(model, decode=LayerPolicy(keep=tuple(range(int(arg)))))

    try:
        spec = parse_configs("test-decode-keep:4")[0]
        assert spec.build(model, None).plan.decode.for_layer(0).keep == (0, 1, 2, 3)
        with pytest.raises(ValueError, match="already registered"):
            configuration("test-decode-keep", uses_plan=False, help="")(_first_n)
    finally:
        CONFIGURATIONS.pop("test-decode-keep")
