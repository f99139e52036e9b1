"""`moetailor tune` from the command line: the printed front and plan, a missed floor, and bad traffic
files answered with the same one-line errors as `calibrate --data`."""
import json

import pytest

from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_model

SMALL = ["--calib-tokens", "512", "--kl-tokens", "256", "--kl-window", "32", "--criteria", "reap"]


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    monkeypatch.setenv("MOETAILOR_NATIVE", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("mixtral", num_experts=8, top_k=2, layers=2).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_tune_prints_the_front_and_the_plan_to_serve(model_dir, tmp_path, capsys):
    out = tmp_path / "tune"
    assert main(["tune", str(model_dir), "--data", "mix", "--max-kl", "10", "--budget", "0.5", *SMALL,
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Pareto front" in printed and "full model" in printed
    assert f"--decode-plan {out / 'plan.json'}" in printed
    assert json.loads((out / "front.json").read_text())["choice"]["met"] is True
    assert (out / "front.md").read_text().startswith("| plan | budget |")


def test_a_missed_floor_exits_1_naming_both_sides(model_dir, tmp_path, capsys):
    assert main(["tune", str(model_dir), "--data", "mix", "--max-kl", "0", "--budget", "0.5", *SMALL,
                 "--out", str(tmp_path / "tune")]) == 1
    printed = capsys.readouterr().out
    assert "no plan meets KL <= 0 at budget 0.5" in printed
    assert "cheapest plan meeting the floor: full model" in printed
    assert "best quality at the target:" in printed and "best-at-target.json" in printed


def _error(capsys) -> str:
    return capsys.readouterr().err.strip().split("error: ", 1)[1]


@pytest.mark.parametrize("content", [None, '{"text": "fine"}\n{"text": \n', '{"text": "fine"}\n{"other": 1}\n'])
def test_bad_traffic_gets_calibrates_one_line_error(model_dir, tmp_path, capsys, content):
    traffic = tmp_path / "traffic.jsonl"
    if content is not None:
        traffic.write_text(content)
    assert main(["calibrate", str(model_dir), "--data", str(traffic), "--out", str(tmp_path / "s.safetensors")]) == 2
    want = _error(capsys)
    assert main(["tune", str(model_dir), "--data", str(traffic), "--max-kl", "1", "--out", str(tmp_path / "t")]) == 2
    got = _error(capsys)
    assert got == want and "\n" not in got


@pytest.mark.parametrize("args, words", [
    (["--budget", "0.5"], "give a quality floor"),
    (["--max-kl", "1", "--budget", "1.5"], "--budget 1.5 must be a share"),
    (["--max-kl", "1", "--budget", "0.5", "--min-tok-s", "10"], "give one target"),
    (["--max-kl", "1", "--gpu", "h200"], "needs both --gpu and --model-shape"),
    (["--min-quality", "0.9", "--budget", "0.5"], "--min-quality needs prompts with answers"),
])
def test_bad_settings_are_one_line_errors(model_dir, tmp_path, capsys, args, words):
    assert main(["tune", str(model_dir), "--data", "mix", *args, "--out", str(tmp_path / "t")]) == 2
    assert words in capsys.readouterr().err
