"""The vLLM plugin's fingerprint of a checkpoint is moetailor's own (``models.loading.fingerprint``),
read from the files without building the model: grouped routing's n_group is part of it, so a plan
made for one grouping is refused for another. Imports no vLLM (the launcher checks plans before
vLLM starts), so this runs in both environments."""
from __future__ import annotations

import json

import pytest

from moetailor.integrations.vllm.plan import checkpoint_fingerprint, load_checked_plan
from moetailor.models.loading import fingerprint_mismatch, load_model, model_fingerprint
from moetailor.models.tiny import tiny_grouped_model
from moetailor.plans.plan import PlanMismatch, uniform_plan


@pytest.fixture(scope="module")
def grouped_pair(tmp_path_factory):
    """The same tiny DeepSeek-V3-style weights saved twice: 16 experts in 4 groups, and (config.json
    edited) in 8 groups; nothing else differs."""
    root = tmp_path_factory.mktemp("grouped")
    model = tiny_grouped_model(seed=3)
    four, eight = root / "four-groups", root / "eight-groups"
    for path in (four, eight):
        model.save_pretrained(path)
    config = json.loads((eight / "config.json").read_text())
    assert config["n_group"] == 4
    config["n_group"] = 8
    (eight / "config.json").write_text(json.dumps(config))
    return model, four, eight


def test_the_plugin_fingerprint_is_the_model_fingerprint(grouped_pair):
    _, four, _ = grouped_pair
    fp = checkpoint_fingerprint(four)
    assert fp == model_fingerprint(load_model(four))
    assert (fp["n_group"], fp["topk_group"]) == (4, 2)


def test_a_checkpoint_differing_only_in_n_group_has_another_fingerprint(grouped_pair):
    _, four, eight = grouped_pair
    a, b = checkpoint_fingerprint(four), checkpoint_fingerprint(eight)
    assert a["router_hash"] == b["router_hash"]   # same weights
    assert {k for k in a if a[k] != b[k]} == {"n_group", "source"}
    assert "n_group" in fingerprint_mismatch(a, b)


def test_a_plan_for_one_grouping_is_refused_for_another(grouped_pair, tmp_path):
    model, four, eight = grouped_pair
    path = tmp_path / "plan.json"
    plan = uniform_plan(load_model(four))
    plan.save(path)
    assert load_checked_plan(path, "plan", four).model["n_group"] == 4
    with pytest.raises(PlanMismatch, match="n_group: file says 4, model has 8"):
        load_checked_plan(path, "plan", eight)
