"""`moetailor eval SPLIT --budgets`: a split tiny model against its original at equal active
parameters, end to end through the CLI (joined rows, usable points, files); bad input named."""
import json

import pytest

from moetailor.cli.main import main
from moetailor.eval.budgets import parse_budgets
from moetailor.models.tiny import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("budgets")
    original = root / "original"
    tiny_model("qwen2_moe", num_experts=8, top_k=2, expert_width=16).save_pretrained(original)
    char_tokenizer().save_pretrained(original)
    split = root / "split"
    assert main(["split", str(original), "--parts", "2", "--data", "text", "--out", str(split), "--tokens", "256", "--seq-len", "32",
                 "--anneal-steps", "50"]) == 0
    return original, split


def test_parse_budgets():
    assert parse_budgets("all", 4) == [1, 2, 3, 4]
    assert parse_budgets("4,2,2", 4) == [2, 4]
    with pytest.raises(ValueError, match=r"out of range.*1\.\.4"):
        parse_budgets("5", 4)
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_budgets("two", 4)


def test_eval_budgets_joins_split_and_original(models, tmp_path, capsys):
    original, split = models
    out = tmp_path / "out"
    assert main(["eval", str(split), "--budgets", "all", "--original", str(original), "--tasks", "addition",
                 "--n", "2", "--seeds", "1", "--max-tokens", "3", "--kl-docs", "1", "--kl-window", "16",
                 "--out", str(out)]) == 0
    result = json.loads((out / "budgets.json").read_text())
    split_pts = [p for p in result["points"] if p["model"] == "split"]
    orig_pts = [p for p in result["points"] if p["model"] == "original"]
    assert [p["k"] for p in split_pts] == [1, 2, 3, 4] and [p["k"] for p in orig_pts] == [1, 2]
    assert [p["active_fraction"] for p in orig_pts] == [0.5, 1.0]
    # 2 prompts per budget cannot resolve a 5-point tolerance: no "usable" verdict, and the table says so
    assert result["prompts"] == 2 and result["usable_points"] == {"split": None, "original": None}
    assert all(p["usable"] is None for p in result["points"])
    md = (out / "budgets.md").read_text()
    assert "too few prompts to tell (2 per budget; a 5-point tolerance needs at least 100)" in md and " *" not in md
    assert (out / "budgets.png").exists() and "active fraction" in md
    assert "accuracy per budget" in capsys.readouterr().out


def test_eval_budgets_rejects_a_model_that_was_not_split(models, tmp_path, capsys):
    original, _ = models
    assert main(["eval", str(original), "--budgets", "all", "--original", str(original), "--tasks", "addition",
                 "--n", "1", "--seeds", "1", "--out", str(tmp_path / "x")]) == 2
    assert "not a split checkpoint" in capsys.readouterr().err


def test_a_usable_verdict_needs_prompts_that_resolve_the_tolerance():
    from moetailor.eval.budgets import budget_table, can_tell, min_prompts

    assert not can_tell(12, 0.05) and can_tell(100, 0.05) and min_prompts(0.05) == 100 and min_prompts(0.1) == 25
    point = {"model": "split", "k": 4, "active_fraction": 1.0, "accuracy": 0.9, "p50": 5, "p90": 9, "usable": True}
    told = budget_table({"parts": 4, "tolerance": 0.05, "prompts": 120, "points": [point],
                         "usable_points": {"split": 1, "original": 0}})
    assert "split 1, original 0" in told and "90.0 *" in told
