"""The report's computed findings and tables on a hand-made results dict with known numbers."""
import pytest

from moetailor.eval.report import findings, markdown, plot, write_docs


def row(variant, config, criterion, keep, acc, p50, p90, hit, eos, kl=0.1):
    return {"variant": variant, "configuration": config, "criterion": criterion, "keep": keep, "sampling": "greedy",
            "task": "all", "accuracy": acc, "accuracy_std": 0.01, "accuracy_per_seed": [acc - 0.01, acc + 0.01], "n": 10, "p50": p50,
            "p90": p90, "mean": p50, "budget_hit": hit, "eos": eos, "max_tokens": None, "kl": kl, "perplexity": 5.0}


@pytest.fixture
def results():
    rows = [row("baseline", "baseline", None, None, 0.80, 20, 30, 0.0, 1.0, kl=0.0),
            row("reap-0.5/pruned", "pruned", "reap", 0.5, 0.50, 18, 40, 0.10, 0.90),
            row("reap-0.5/reverse", "reverse", "reap", 0.5, 0.60, 12, 25, 0.00, 1.00),
            row("reap-0.5/phase-aware", "phase-aware", "reap", 0.5, 0.70, 22, 60, 0.20, 0.80),
            row("ean-0.5/pruned", "pruned", "ean", 0.5, 0.10, 60, 60, 0.90, 0.10),
            row("ean-0.5/reverse", "reverse", "ean", 0.5, 0.55, 25, 30, 0.00, 1.00),
            row("ean-0.5/phase-aware", "phase-aware", "ean", 0.5, 0.05, 60, 60, 0.95, 0.05)]
    return {"command": "moetailor eval reference --sweep paper", "model": {"name": "reference", "model_type": "qwen2_moe",
            "num_experts": 64, "top_k": 8, "router_hash": "abc"},
            "settings": {"tasks": [], "n": 10, "seeds": [0], "sampling": ["greedy"], "temperature": 1.0, "top_p": 0.95,
                         "max_tokens": {"addition": 162}, "budget_rule": "2x", "heldout": {"tokens_scored": 100}},
            "versions": {"moetailor": "0.1.0", "torch": "2", "transformers": "5"},
            "timing": {"computed_cells": 7, "cached_cells": 0, "generated_tokens_all_cells": 1000,
                       "generation_s_all_cells": 10.0},
            "rows": rows, "histograms": {"baseline": {"greedy": [0] * 19 + [3]}}}


def test_findings_answer_the_three_questions(results):
    text = "\n".join(findings(results, "greedy"))
    assert "Phase-aware beats Pruned on accuracy in 1 of 2 plans (0 ties); mean difference +7.5 points." in text
    assert "median length below Baseline's (20 tokens) in 1 of 2 plans (mean p50 18.5)" in text
    assert "Phase-aware: mean budget-hit share 57.5% (Baseline 0.0%)" in text
    # ean collapses (accuracy < half of 80% and runaway generation); reap's 50% pruned is not below 40%
    assert "ean-0.5/pruned (10.0%, hit 90.0%), ean-0.5/phase-aware (5.0%, hit 95.0%)." in text
    assert "reap-0.5/pruned (" not in text
    assert "Pruned accuracy by criterion (mean over keep ratios): reap 50.0%, ean 10.0%." in text


def test_docs_page_keeps_hand_written_notes(results, tmp_path):
    plot(results, tmp_path, "greedy")
    docs = tmp_path / "docs" / "results.md"
    docs.parent.mkdir()
    docs.write_text("old\n<!-- notes -->\nWhat we saw.\n<!-- /notes -->\nold table\n")
    write_docs(results, tmp_path, docs, elapsed_s=90)
    text = docs.read_text()
    assert "<!-- notes -->\nWhat we saw.\n<!-- /notes -->" in text
    assert "old table" not in text
    assert "moetailor eval reference --sweep paper" in text and "1.5 minutes" in text
    assert (tmp_path / "docs" / "results" / "accuracy_vs_keep.png").is_file()
    assert "](results/length_distribution.png)" in text
    assert "| ean | 50% | phase-aware | 5.0 ± 1.0 | 60 | 60 | 95.0 | 5.0 | 0.1000 | 5.00 |" in markdown(results)


def test_one_seed_prints_no_spread():
    """One seed measures no spread: "n/a", not a "± 0.0" that reads as a perfectly stable figure."""
    from moetailor.eval.report import accuracy_spread

    assert accuracy_spread({"accuracy_std": 0.0, "accuracy_per_seed": [0.5]}) == "n/a"
    assert accuracy_spread({"accuracy_std": 0.02, "accuracy_per_seed": [0.48, 0.52]}) == "2.0"
