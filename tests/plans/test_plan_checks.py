"""A plan file is checked when it is read: it names the model it fits (a complete fingerprint), and
its kept expert ids are distinct, in range and on the model's MoE layers."""
import json
from pathlib import Path

import pytest

from moetailor.models.tiny import tiny_model
from moetailor.plans import Plan, uniform_plan
from moetailor.routing import LayerPolicy

PLAN = Path(__file__).resolve().parents[2] / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"


def _write(tmp_path, data) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_the_bundled_plan_passes():
    assert Plan.load(PLAN).kept_experts("decode")


@pytest.mark.parametrize("model", [{}, {"model_type": "qwen2_moe"}, [], "reference"])
def test_a_plan_without_a_model_fingerprint_is_refused(model, tmp_path):
    data = json.loads(PLAN.read_text())
    data["model"] = model
    with pytest.raises(ValueError, match="fingerprint.*regenerate it with `moetailor plan`"):
        Plan.load(_write(tmp_path, data))


def test_a_plan_built_without_a_fingerprint_does_not_apply_to_a_model():
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))
    plan.check_model(model)
    with pytest.raises(ValueError, match="no complete model fingerprint"):
        Plan(model={}, decode=plan.decode).check_model(model)


@pytest.mark.parametrize("keep, message", [
    ([3] * 9, r"expert\(s\) \[3\] more than once"),
    ([0, 1, 2, 3, 4, 5, 6, 6, 7], r"expert\(s\) \[6\] more than once"),
    (list(range(31)) + [64], r"out of range 0..63"),
    ([-1] + list(range(8)), r"out of range 0..63"),
])
def test_duplicate_or_out_of_range_keep_ids_are_refused(keep, message, tmp_path):
    data = json.loads(PLAN.read_text())
    data["decode"]["2"] = {"keep": keep}
    with pytest.raises(ValueError, match=message):
        Plan.load(_write(tmp_path, data))


def test_policies_for_layers_the_model_lacks_are_refused(tmp_path):
    data = json.loads(PLAN.read_text())
    data["decode"]["17"] = {"keep": list(range(8))}
    with pytest.raises(ValueError, match=r"layer\(s\) \[17\], which are not MoE layers"):
        Plan.load(_write(tmp_path, data))


def test_duplicate_ids_never_make_a_layer_policy():
    with pytest.raises(ValueError, match="more than once"):
        LayerPolicy(keep=(3, 3, 4))
