"""Third reliability round, command line (docs/reliability.md): corrupt statistics refused
when they load, distillation hyper-parameters checked before training and never an export of
non-finite weights, and one-line errors (exit 2, no traceback) for deep metadata, a folder as a plan,
a --seq-len past the model's positions, non-UTF-8 files and plan metadata with terminal escapes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetailor.calibration import ExpertStats, LayerStats
from moetailor.cli.main import main
from moetailor.models.loading import model_fingerprint
from moetailor.models.tiny import tiny_model

ASSETS = Path(__file__).resolve().parents[2] / "src" / "moetailor" / "assets"
PLAN = ASSETS / "plans" / "reference-reap-50.json"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2_moe", num_experts=8, top_k=2)


def stats_file(model, tmp_path, change=None) -> str:
    fp = model_fingerprint(model)
    layers = {}
    for i in fp["moe_layers"]:
        st = LayerStats.zeros(8, fold=False)
        st.frequency[:] = torch.arange(1, 9, dtype=torch.float64) * 10
        st.mass[:] = torch.arange(1, 9, dtype=torch.float64)
        st.ean[:] = st.frequency * 2
        st.weighted_ean[:] = st.mass * 3
        st.coselect[:] = torch.eye(8, dtype=torch.float64) * st.frequency
        st.beta_hist[500] = 100
        if change is not None:
            change(st)
        layers[i] = st
    path = tmp_path / "stats.safetensors"
    ExpertStats({"model": fp, "tokens": 100, "data": "hand", "gate": {"name": "renorm"}}, layers).save(path)
    return str(path)


def one_line_error(capsys, argv, *needles) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def _set(name, value):
    def change(st):
        getattr(st, name)[0] = value
    return change


def _short_mass(st):
    st.mass = torch.ones(5, dtype=torch.float64)


@pytest.mark.parametrize("change, needle", [
    (_set("weighted_ean", float("nan")), "weighted_ean holds 1 NaN"),
    (_set("mass", float("inf")), "mass holds 1 NaN or infinite"),
    (_set("ean", -4.0), "ean holds negative"),
    (_short_mass, "mass has shape [5], expected [8]"),
])
def test_plan_refuses_corrupt_statistics(tiny, tmp_path, capsys, change, needle):
    path = stats_file(tiny, tmp_path, change)
    one_line_error(capsys, ["plan", path, "--criterion", "reap", "--keep", "0.5", "--out", str(tmp_path / "p.json")],
                   needle, "rerun `moetailor calibrate`")
    assert not (tmp_path / "p.json").exists()


def test_healthy_statistics_still_plan(tiny, tmp_path):
    path = stats_file(tiny, tmp_path)
    assert main(["plan", path, "--criterion", "reap", "--keep", "0.5", "--out", str(tmp_path / "p.json")]) == 0


def test_deeply_nested_metadata_is_one_line(tiny, tmp_path, capsys):
    from safetensors.torch import save_file

    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "deep.safetensors"
    save_file({"layer0.frequency": torch.zeros(8, dtype=torch.float64)}, str(path),
              metadata={"format": "moetailor-expert-stats", "version": "1", "meta": deep})
    one_line_error(capsys, ["plan", str(path), "--criterion", "reap", "--keep", "0.5", "--out",
                            str(tmp_path / "p.json")], "metadata")
    plan = json.loads(PLAN.read_text())
    text = json.dumps(plan)[:-1] + ', "deep": ' + deep + "}"
    (tmp_path / "deep.json").write_text(text)
    one_line_error(capsys, ["info", str(tmp_path / "deep.json")], "nests too deeply")


def test_a_folder_or_non_utf8_file_as_a_plan_is_one_line(tmp_path, capsys):
    (tmp_path / "plans.json").mkdir()
    one_line_error(capsys, ["info", str(tmp_path / "plans.json")], "is a folder")
    one_line_error(capsys, ["generate", "reference", "--prompt", "x", "--plan", str(tmp_path)], str(tmp_path))
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"format": "caf\xe9"}')
    one_line_error(capsys, ["info", str(bad)], str(bad), "UTF-8")


def test_non_utf8_data_and_task_files_name_the_file(tmp_path, capsys):
    bad = tmp_path / "tasks.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    from moetailor.calibration.data import _file_documents
    from moetailor.eval.user_tasks import read_jsonl

    for call in (lambda: read_jsonl(bad), lambda: next(iter(_file_documents(bad)))):
        with pytest.raises(ValueError, match="not UTF-8") as info:
            call()
        assert str(bad) in str(info.value)


def test_calibrate_seq_len_past_the_model_positions(tmp_path, capsys):
    one_line_error(capsys, ["calibrate", "reference", "--seq-len", "4096", "--out", str(tmp_path / "s.safetensors")],
                   "--seq-len 4096", "1024 positions")
    assert not (tmp_path / "s.safetensors").exists()


def test_info_prints_plan_metadata_escapes_as_text(tmp_path, capsys):
    plan = json.loads(PLAN.read_text())
    plan["meta"]["criterion"] = "reap\x1b[2J\x1b]0;owned\x07"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out


@pytest.mark.parametrize("flag", ["nan", "inf", "-inf"])
def test_distill_refuses_non_finite_learning_rates_before_training(tmp_path, capsys, flag):
    one_line_error(capsys, ["distill", "reference", str(PLAN), "--steps", "2", f"--lr={flag}", "--out",
                            str(tmp_path / "out")], "--lr", "finite")
    assert not (tmp_path / "out").exists()


def test_distill_never_exports_non_finite_weights(tmp_path):
    from moetailor.plans import uniform_plan
    from moetailor.routing import LayerPolicy
    from moetailor.training.distill import Student, export

    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))
    student = Student(model, plan)
    with torch.no_grad():   # what a diverged run leaves: the router weights are NaN
        student.trainable()[0][1].fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        export(student, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_disk_full_while_writing_is_one_line_and_leaves_nothing(tiny, tmp_path, capsys, monkeypatch):
    """Fault injection: the statistics writer hits ENOSPC (a full disk) inside the atomic writer."""
    import errno
    import os

    path = stats_file(tiny, tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("moetailor.plans.plan.write_json", full)
    out = tmp_path / "plans"
    out.mkdir()
    one_line_error(capsys, ["plan", path, "--criterion", "reap", "--keep", "0.5", "--out", str(out / "p.json")],
                   "No space left on device", "free disk space")
    assert list(out.iterdir()) == []
