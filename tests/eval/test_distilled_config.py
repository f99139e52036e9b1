"""The `distilled:DIR` evaluation configuration: full prefill on the original model, decode on the
distilled decoder under its plan, through the disaggregated engine. An untrained student (SE2 = 0,
original router and norms) IS the masked decoder, so its results must equal Phase-aware's exactly,
token for token in the engine."""
import json

import pytest

from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.training.distill import Student, export


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distilled-eval")
    model = tiny_model("qwen2_moe", seed=4, num_experts=8, top_k=2)
    model.save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 3, 6)), criterion="test")
    plan.save(root / "plan.json")
    export(Student(model, plan), root / "student", source=root / "model")
    return root


def test_untrained_distilled_decoder_equals_phase_aware(setup, tmp_path):
    root = setup
    out = tmp_path / "eval"
    assert main(["eval", str(root / "model"), "--plan", str(root / "plan.json"), "--configs",
                 f"phase-aware,distilled:{root / 'student'}", "--tasks", "addition,reverse", "--n", "3",
                 "--seeds", "1", "--max-tokens", "6", "--kl-docs", "1", "--kl-window", "32", "--out", str(out)]) == 0
    rows = {r["configuration"]: r for r in json.loads((out / "results.json").read_text())["rows"] if r["task"] == "all"}
    aware, distilled = rows["phase-aware"], rows[f"distilled:{root / 'student'}"]
    assert distilled["p50"] == aware["p50"] and distilled["accuracy"] == aware["accuracy"]
    assert distilled["kl"] == pytest.approx(aware["kl"], rel=1e-4) and aware["kl"] > 1e-3   # not the full model


def test_disaggregated_distilled_decoder_generates_like_the_masked_model(setup):
    from moetailor.plans import Plan
    from moetailor.serving import LLM, SamplingParams
    from moetailor.serving.disagg import DisaggregatedLLM

    root = setup
    plan = Plan.load(root / "plan.json")
    prompts, params = ["add 12 + 34\n", "reverse a b c\n"], SamplingParams(max_tokens=10, temperature=0)
    with DisaggregatedLLM(str(root / "model"), decode_model=str(root / "student")) as dis:   # plan from the sidecar
        got = [o.token_ids for o in dis.generate(prompts, params)]
    masked = [o.token_ids for o in LLM(str(root / "model"), plan).generate(prompts, params)]
    full = [o.token_ids for o in LLM(str(root / "model")).generate(prompts, params)]
    assert got == masked and got != full


def test_a_trained_decoder_with_its_own_router_is_evaluated(setup, tmp_path):
    root = setup
    student = tmp_path / "trained"
    assert main(["distill", str(root / "model"), str(root / "plan.json"), "--data", "tasks", "--steps", "1", "--batch-size", "2",
                 "--seq-len", "16", "--lr", "0.05", "--out", str(student)]) == 0
    out = tmp_path / "eval"
    assert main(["eval", str(root / "model"), "--plan", str(root / "plan.json"), "--configs", f"distilled:{student}",
                 "--tasks", "reverse", "--n", "2", "--seeds", "1", "--max-tokens", "4", "--kl-docs", "1",
                 "--kl-window", "32", "--out", str(out)]) == 0
    rows = [r for r in json.loads((out / "results.json").read_text())["rows"] if r["task"] == "all"]
    assert len(rows) == 1 and rows[0]["kl"] > 0


def test_distilled_from_another_model_is_refused(setup, tmp_path, capsys):
    root = setup
    other = tmp_path / "other"
    tiny_model("qwen2_moe", seed=9, num_experts=8, top_k=2).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    assert main(["eval", str(other), "--configs", f"distilled:{root / 'student'}", "--tasks", "reverse", "--n", "1",
                 "--seeds", "1", "--out", str(tmp_path / "x")]) == 2
    assert "distilled from another model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()                 # no empty run folder left behind


def test_a_missing_distilled_folder_leaves_no_run_folder(setup, tmp_path, capsys):
    root = setup
    assert main(["eval", str(root / "model"), "--configs", f"distilled:{tmp_path / 'nowhere'}", "--tasks", "reverse",
                 "--n", "1", "--seeds", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "moetailor distill MODEL PLAN --out" in err, err   # not "no sidecar"
    assert not (tmp_path / "run").exists()
