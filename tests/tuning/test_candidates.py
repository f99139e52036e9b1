"""A candidate's plan (pool per layer, folding, top-k) and its budget as expert weights read per step."""
import pytest

from moetailor.calibration import calibrate
from moetailor.models.loading import model_fingerprint
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans.criteria import expert_scores, top_experts
from moetailor.serving import LLM, SamplingParams
from moetailor.tuning.candidates import Candidate, candidate_plan


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2, layers=3)
    tok = char_tokenizer()
    stats = calibrate(model, tok, "mix", 512, fold=True, progress=False, seq_len=64, batch_tokens=256)
    path = tmp_path_factory.mktemp("stats") / "stats.safetensors"
    stats.save(path)
    return model, tok, stats, str(path)


def test_budget_is_the_expected_share_of_experts_read():
    c = Candidate("reap", (4, 4, 4))
    assert c.pool_share(8) == 0.5
    assert c.read_share(8, 2, 1) == pytest.approx(2 / 8)          # batch 1 reads k experts whatever the pool
    assert c.read_share(8, 2, 512) == pytest.approx(0.5)          # a large batch reads the whole pool
    assert Candidate("reap", (8, 8, 8), top_k=1).read_share(8, 2, 1) == pytest.approx(1 / 8)
    assert Candidate("reap", (8, 8, 8)).is_full(8) and not Candidate("reap", (8, 8, 8), top_k=1).is_full(8)
    assert Candidate("ean", (8, 4, 2), "fold", 1, "sensitivity").key == "ean-s8.4.2-fold-k1"
    assert Candidate.from_json(Candidate("ean", (8, 4, 2), "fold", 1, "sensitivity").to_json()).key == "ean-s8.4.2-fold-k1"
    with pytest.raises(ValueError, match="pool mode"):
        Candidate("reap", (4,), "sideways")


def test_candidate_plans_keep_the_top_experts_and_run_in_the_engine(calibrated):
    model, tok, stats, path = calibrated
    fp = model_fingerprint(model)
    scores = expert_scores(stats, "ean")
    masked = candidate_plan(Candidate("ean", (6, 4, 2)), stats, fp, path)
    for layer, m in zip(fp["moe_layers"], (6, 4, 2)):
        assert masked.decode.for_layer(layer).keep == top_experts(scores[layer], m)
        assert masked.prefill.for_layer(layer).is_identity               # phase-aware: prefill full
    assert masked.fold_stats is None and masked.meta["keep_ratio"] == 0.5
    folded = candidate_plan(Candidate("ean", (4, 4, 4), "fold", 1), stats, fp, path)
    assert all(p.pool_mode == "fold" and p.top_k == 1 for p in folded.decode.layers.values())
    assert folded.fold_stats == path
    llm = LLM(model, tokenizer=tok, max_num_seqs=4)
    for plan in (masked, folded):
        llm.set_plan(plan)
        out = llm.generate(["add 1 + 2"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) >= 1


def test_novice_merged_and_protected_candidates(calibrated):
    model, tok, stats, path = calibrated
    fp = model_fingerprint(model)
    merged = Candidate("frequency", (4, 4, 4), "merge", merge="hcsmoe", protect_super=1)
    assert merged.key == "frequency-u4-hcsmoe-super1" and Candidate.from_json(merged.to_json()) == merged
    assert merged.describe(8) == "HC-SMoE merged 4/8 +1 super" and merged.checkpoint and merged.runs_on_vllm()
    novice = Candidate("mone", (4, 4, 4), "novice")
    assert novice.key == "mone-u4-novice" and novice.runs_on_vllm() and not novice.checkpoint
    with pytest.raises(ValueError, match="names its method"):
        Candidate("frequency", (4, 4, 4), "merge")
    with pytest.raises(ValueError, match="top-k"):
        Candidate("mone", (4, 4, 4), "novice", top_k=1)
    plan = candidate_plan(novice, stats, fp, path)
    assert all(p.pool_mode == "novice" for p in plan.decode.layers.values()) and plan.fold_stats == path
    for method in ("hcsmoe", "msmoe"):
        plan = candidate_plan(Candidate("frequency", (4, 4, 4), "merge", merge=method), stats, fp, path, model=model)
        assert plan.prefill.is_identity and all(p.merges and len(p.merge) == 4 for p in plan.decode.layers.values())
    with pytest.raises(ValueError, match="one expert count"):
        candidate_plan(Candidate("frequency", (6, 4, 4), "merge", merge="hcsmoe"), stats, fp, path)
    protected = candidate_plan(Candidate("ean", (4, 4, 4), protect_super=2), stats, fp, path)
    assert sum(len(v) for v in protected.meta["super_experts"].values()) == 2
