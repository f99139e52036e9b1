"""`--device` on every offline verb: `cpu` and `auto` run through the one placement
(``moetailor.device``) and give the same results; a GPU torch does not see is a one-line error
(exit 2) before any model loads, with nothing written."""
import json

import pytest
import torch

from moetailor.calibration.stats import ExpertStats
from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy

NO_GPU = not torch.cuda.is_available()


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    monkeypatch.setenv("MOETAILOR_NATIVE", "0")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, a decode plan for it, and a folder with its config but no
    weights (a verb that loaded the model before checking --device would fail there with another
    message)."""
    root = tmp_path_factory.mktemp("device")
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2, expert_width=16)
    model.save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3))).save(root / "plan.json")
    (root / "weightless").mkdir()
    (root / "weightless" / "config.json").write_text((root / "model" / "config.json").read_text())
    return root


def verbs(model, plan, out) -> dict[str, list[str]]:
    """Each offline verb with small sizes, on ``model``, writing ``out``."""
    out = str(out)
    return {
        "calibrate": ["calibrate", model, "--data", "tasks", "--tokens", "128", "--out", f"{out}.safetensors"],
        "calibrate-streamed": ["calibrate", model, "--data", "tasks", "--tokens", "128", "--stream", "on",
                               "--out", f"{out}.safetensors"],
        "eval": ["eval", model, "--configs", "baseline", "--tasks", "addition", "--n", "2", "--seeds", "1",
                 "--max-tokens", "4", "--kl-docs", "1", "--kl-window", "32", "--out", out],
        "eval-kl": ["eval", model, "--metric", "kl", "--plan", plan, "--kl-docs", "1", "--kl-window", "32",
                    "--out", out],
        "distill": ["distill", model, plan, "--data", "tasks", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                    "--out", out],
        "tune": ["tune", model, "--data", "mix", "--max-kl", "10", "--budget", "0.5", "--calib-tokens", "256",
                 "--kl-tokens", "128", "--kl-window", "32", "--criteria", "reap", "--no-allocation", "--out", out],
        "split": ["split", model, "--parts", "2", "--data", "text:fortunes", "--tokens", "128", "--seq-len", "32",
                  "--anneal-steps", "20", "--out", out],
        "search-k": ["search-k", model, "--data", "tasks", "--budget", "2", "--tokens", "64", "--window", "16", "--heldout-docs", "0",
                     "--max-rounds", "1", "--out", f"{out}.json"],
    }


def test_calibrate_on_cpu_and_auto_gives_the_same_statistics(work, tmp_path, capsys):
    got = {}
    for device in ("cpu", "auto"):
        for name in ("calibrate", "calibrate-streamed"):
            args = verbs(str(work / "model"), str(work / "plan.json"), tmp_path / f"{name}-{device}")[name]
            assert main([*args, "--device", device]) == 0
            printed = " ".join(capsys.readouterr().out.split())
            assert f" on {'cuda:0' if device == 'auto' and not NO_GPU else 'cpu'}: peak " in printed
            got[name, device] = ExpertStats.load(args[-1])
    reference = got["calibrate", "cpu"]
    for key, stats in got.items():
        for i, layer in reference.layers.items():
            assert torch.equal(stats.layers[i].frequency, layer.frequency), key
            torch.testing.assert_close(stats.layers[i].mass, layer.mass, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(stats.layers[i].ean, layer.ean, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "auto"])
@pytest.mark.parametrize("verb", ["eval", "eval-kl", "distill", "tune", "split", "search-k"])
def test_every_offline_verb_runs_on_the_device_it_is_given(work, tmp_path, verb, device):
    args = verbs(str(work / "model"), str(work / "plan.json"), tmp_path / "out")[verb]
    assert main([*args, "--device", device]) == 0
    written = [p for p in tmp_path.iterdir() if p.name.startswith("out")]
    assert written, f"{verb} wrote nothing"


def test_eval_kl_is_the_same_on_cpu_and_auto(work, tmp_path):
    kl = {}
    for device in ("cpu", "auto"):
        args = verbs(str(work / "model"), str(work / "plan.json"), tmp_path / device)["eval-kl"]
        assert main([*args, "--device", device]) == 0
        kl[device] = json.loads((tmp_path / device / "kl.json").read_text())["kl"]
    assert kl["cpu"] == pytest.approx(kl["auto"], rel=1e-4, abs=1e-6)


@pytest.mark.skipif(not NO_GPU, reason="torch sees a GPU here")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
@pytest.mark.parametrize("verb", ["calibrate", "calibrate-streamed", "eval", "eval-kl", "distill", "tune", "split",
                                  "search-k"])
def test_a_gpu_torch_does_not_see_is_refused_before_the_model_loads(work, tmp_path, capsys, verb, device):
    args = verbs(str(work / "weightless"), str(work / "plan.json"), tmp_path / "out")[verb]
    assert main([*args, "--device", device]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"--device {device}: torch sees no GPU" in lines[0] and "--device cpu" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []                                   # nothing written


def test_a_misspelt_device_is_refused_by_the_parser(work, tmp_path, capsys):
    args = verbs(str(work / "model"), str(work / "plan.json"), tmp_path / "out")["calibrate"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--device", "gpu"])
    assert e.value.code == 2
    assert "choose auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_search_k_without_data_on_a_local_model_names_the_flag(work, tmp_path, capsys):
    """Was a TypeError traceback (the --data default was read before it was resolved)."""
    assert main(["search-k", str(work / "model"), "--budget", "2", "--out", str(tmp_path / "k.json")]) == 2
    err = capsys.readouterr().err
    assert "--data is required" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
