"""Folding and skipping configurations: registered, built from specs, run through the model."""
import pytest
import torch

from moetailor.calibration import calibrate_batches
from moetailor.eval.configurations import CONFIGURATIONS, parse_configs
from moetailor.eval.metrics import HeldoutScorer
from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy, RoutingController

E, K = 8, 4
NAMES = ("fold-prefill", "drop-prefill", "fold-decode", "drop-decode", "plan+fold", "plan+drop", "topk-decode",
         "topk-prefill", "layer-k", "bhep", "skip", "skip-decode")


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_moe", seed=0, num_experts=E, top_k=K, layers=2)


@pytest.fixture(scope="module")
def stats_path(model, tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 96, (4, 16), generator=g) for _ in range(3)]
    path = tmp_path_factory.mktemp("stats") / "fold.safetensors"
    calibrate_batches(model, batches, fold=True, progress=False).save(path)
    return path


def build(spec, model, plan=None):
    return parse_configs(spec)[0].build(model, plan).plan


def test_every_technique_configuration_is_registered():
    assert set(NAMES) <= set(CONFIGURATIONS)


def test_fold_and_drop_configurations(model, stats_path):
    p = build(f"fold-decode:3@{stats_path}", model)
    assert p.prefill.is_identity and p.decode.for_layer(0).batch_pool == 3 and p.decode.for_layer(0).fold
    assert p.fold_stats == str(stats_path) and p.meta["configuration"] == "fold-decode:3"
    assert RoutingController.of(model).fold_tables            # attached, so held-out KL can compile it
    p = build(f"drop-decode:3@{stats_path}", model)
    assert not p.decode.for_layer(1).fold and p.fold_stats    # same pool importance as fold-decode
    p = build("drop-prefill:2", model)
    assert p.decode.is_identity and p.prefill.for_layer(0).token_keep == 2 and p.fold_stats is None
    p = build(f"fold-prefill:2@{stats_path}", model)
    assert p.prefill.for_layer(1).token_keep == 2 and p.prefill.for_layer(1).fold


def test_static_pool_configurations_take_stats_from_the_base_plan(model, stats_path):
    base = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3, 4)), criterion="reap")
    from dataclasses import replace
    base = replace(base, fold_stats=str(stats_path))
    folded, dropped = build("plan+fold", model, base), build("plan+drop", model, base)
    assert folded.decode.for_layer(0).pool_mode == "fold" and folded.decode.for_layer(0).keep == (0, 1, 2, 3, 4)
    assert dropped.decode.for_layer(0).pool_mode == "drop" and folded.prefill.is_identity
    assert folded.meta["criterion"] == "reap" and folded.fold_stats == str(stats_path)


def test_skipping_configurations(model, stats_path):
    from moetailor.calibration import ExpertStats

    base = uniform_plan(model, decode=LayerPolicy(keep=tuple(range(E))))
    from dataclasses import replace
    base = replace(base, meta={"stats": str(stats_path)})
    stats = ExpertStats.load(stats_path)
    p = build("skip", model, base)
    for layer in (0, 1):
        beta = stats.layers[layer].beta
        assert p.decode.for_layer(layer).skip_beta == pytest.approx(beta, abs=1e-6)
        assert p.prefill.for_layer(layer).skip_beta == pytest.approx(beta, abs=1e-6)
    assert build("skip-decode", model, base).prefill.is_identity
    p = build("topk-decode:2", model)
    assert p.decode.for_layer(0).top_k == 2 and p.prefill.is_identity
    p = build("topk-prefill:3", model)
    assert p.prefill.for_layer(1).top_k == 3 and p.decode.is_identity
    p = build("layer-k:1/3", model)
    assert [p.decode.for_layer(i).top_k for i in (0, 1)] == [1, 3] == [p.prefill.for_layer(i).top_k for i in (0, 1)]
    p = build("bhep:4/4/2/0", model)
    assert p.decode.for_layer(0).top_k is None and p.decode.for_layer(1).top_k == 2


@pytest.mark.parametrize("spec, match", [
    ("fold-decode:0", r"D=0 must be in \[1, 8\]"), ("fold-decode:9", r"D=9 must be in \[1, 8\]"),
    ("fold-prefill:0", r"K_pre=0 must be in \[1, 4\]"), ("drop-prefill:5", r"K_pre=5 must be in \[1, 4\]"),
    ("topk-decode:0", r"k'=0 must be in \[1, 4\]"), ("topk-prefill:5", r"k'=5 must be in \[1, 4\]"),
    ("layer-k:1/2/3", "has 3 entries but the model has 2 MoE layers"),
    ("bhep:2/4/2/3", "p=3 is outside the MoE layers 0..1"), ("fold-decode:x", "integer"),
])
def test_bad_arguments(model, spec, match):
    with pytest.raises(ValueError, match=match):
        build(spec, model)


def test_stats_of_another_model_and_missing_stats(model, stats_path, tmp_path, monkeypatch):
    from moetailor.calibration import StatsMismatch

    other = tiny_model("qwen2_moe", seed=9, num_experts=E, top_k=K, layers=2)
    with pytest.raises(StatsMismatch, match="router_hash"):
        build(f"fold-decode:3@{stats_path}", other)
    with pytest.raises(FileNotFoundError, match="--fold --out"):
        build(f"fold-decode:3@{tmp_path / 'nope.safetensors'}", model)
    monkeypatch.setenv("MOETAILOR_CACHE", str(tmp_path))        # empty cache, model without a tokenizer
    with pytest.raises(ValueError, match="no fold statistics were given"):
        build("fold-decode:3", other)


def test_configured_plans_run_in_the_model_and_the_engine(model, stats_path):
    g = torch.Generator().manual_seed(3)
    scorer = HeldoutScorer(model, torch.randint(2, 96, (4, 16), generator=g).tolist())
    full = build(f"fold-decode:{E}@{stats_path}", model)
    assert scorer.score(full.prefill, full.decode).kl == pytest.approx(0.0, abs=1e-7)
    small = build(f"fold-decode:2@{stats_path}", model)
    drop = build(f"drop-decode:2@{stats_path}", model)
    kl_fold, kl_drop = scorer.score(small.prefill, small.decode).kl, scorer.score(drop.prefill, drop.decode).kl
    assert kl_fold > 1e-5 and kl_drop > 1e-5 and kl_fold != kl_drop

    from moetailor.serving import LLM, SamplingParams
    llm = LLM(model, small, max_num_seqs=4, num_kv_blocks=16, max_model_len=64)
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs)
    decode = [r for r in llm.step_log if r.phase == "decode"]
    assert decode and all(max(r.distinct_experts.values()) <= 2 for r in decode)
