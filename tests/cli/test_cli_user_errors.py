"""Bad user input through the real `moetailor` entry point: exit code 2 and one line naming the
problem and the fix, never a traceback (tracebacks are for bugs)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_model

ASSETS = Path(__file__).resolve().parents[2] / "src" / "moetailor" / "assets"
PLAN = ASSETS / "plans" / "reference-reap-50.json"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2_moe", num_experts=8, top_k=2).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _plan(tmp_path, **changes) -> str:
    data = json.loads(PLAN.read_text())
    for key, value in changes.items():
        if value is None:
            del data["model"][key]
        else:
            data[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def _stats_with_int_layers(tmp_path) -> str:
    from safetensors.torch import save_file

    meta = {"model": {"model_type": "qwen2_moe", "moe_layers": 3, "num_experts": 8, "top_k": 2, "router_hash": "x"},
            "tokens": 10, "data": "tasks"}
    path = tmp_path / "stats.safetensors"
    save_file({"layer0.frequency": torch.zeros(8, dtype=torch.float64)}, str(path),
              metadata={"format": "moetailor-expert-stats", "version": "1", "meta": json.dumps(meta)})
    return str(path)


def _broken_model(tmp_path, tiny_dir, how: str) -> str:
    path = tmp_path / "broken"
    shutil.copytree(tiny_dir, path)
    if how == "truncated":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "json":
        (path / "config.json").write_text('{"model_type": "qwen2_moe", ')
    elif how == "no-type":
        (path / "config.json").write_text('{"hidden_size": 64}')
    return str(path)


def _corrupt_state(tmp_path) -> str:
    partial = tmp_path / "student.partial"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    return str(tmp_path / "student")


CASES = {
    "plan model of the wrong type": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--plan", _plan(t, model="reference")],
        "model fingerprint object"),
    "plan decode of the wrong type": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--plan", _plan(t, decode=[1, 2])],
        "decode (a phase policy) must be an object"),
    "plan layer policy of the wrong type": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--plan", _plan(t, decode={"0": 5})],
        "layer policy must be an object"),
    "plan keep of the wrong type": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--plan", _plan(t, decode={"0": {"keep": "all"}})],
        "'keep' must be a list of expert ids"),
    "plan without num_experts": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--plan", _plan(t, num_experts=None)],
        "num_experts missing"),
    "stats with moe_layers an int": (
        lambda t, m: ["plan", _stats_with_int_layers(t), "--criterion", "reap", "--keep", "0.5",
                      "--out", str(t / "p.json")],
        "moe_layers must be a list"),
    "truncated model.safetensors": (lambda t, m: ["info", _broken_model(t, m, "truncated")], "may be truncated"),
    "malformed config.json": (lambda t, m: ["info", _broken_model(t, m, "json")], "config.json"),
    "config.json without model_type": (lambda t, m: ["info", _broken_model(t, m, "no-type")], "config.json"),
    "--threads -1 (generate)": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--threads", "-1"], "--threads must be at least 1"),
    "--threads -1 (distill)": (
        lambda t, m: ["distill", "reference", str(PLAN), "--steps", "1", "--threads", "-1", "--out", str(t / "d")],
        "--threads must be at least 1"),
    "corrupt distill state.pt": (
        lambda t, m: ["distill", "reference", str(PLAN), "--steps", "2", "--resume", "--out", _corrupt_state(t)],
        "not a readable distillation checkpoint"),
    "--decode-model /nope": (
        lambda t, m: ["generate", "reference", "--prompt", "hi", "--decode-model", "/nope"],
        "neither a bundled model (reference, reference-qwen3) nor a local checkpoint"),
    "--vllm-experts-kernel on the engine": (
        lambda t, m: ["serve", "reference", "--vllm-experts-kernel"], "--vllm-experts-kernel is for --backend vllm"),
    "--vllm-novice on the engine": (
        lambda t, m: ["serve", "reference", "--vllm-novice"], "--vllm-novice is for --backend vllm"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line_and_exit_2(case, tmp_path, tiny_dir, capsys):
    argv, message = CASES[case]
    code = main(argv(tmp_path, tiny_dir))          # an uncaught exception (a traceback) fails the test here
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("moetailor "), err
    assert message in lines[0] and "Traceback" not in err
