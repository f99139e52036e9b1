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


def test_a_floor_on_few_prompts_is_not_claimed(model_dir, tmp_path, capsys):
    """A quality floor is met only when the paired 95% interval of the share of the full model's accuracy
    lies above it. Here the best plan at the target keeps 58% of the full model on 12 prompts: above a 50%
    floor as a point estimate (which used to be printed as "chosen: ... meets"), but the interval straddles
    it, so tune names it as a pick with that caveat and the prompts that would decide, exits 1 and writes
    no plan.json."""
    from moetailor.models import load_model
    from moetailor.serving import LLM, SamplingParams

    llm = LLM(load_model(model_dir), tokenizer=char_tokenizer(), max_num_seqs=8)
    prompts = [f"add {a} + {b}\n" for a in range(3) for b in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt": p, "answer": o.text.strip(), "match": "contains"}) + "\n"
                               for p, o in zip(prompts, outs) if o.text.strip()))
    out = tmp_path / "tune"
    assert main(["tune", str(model_dir), "--data", str(traffic), "--min-quality", "0.5", "--budget", "0.75",
                 "--evaluate", "3", "--no-allocation", *SMALL, "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    data = json.loads((out / "front.json").read_text())
    n = data["summary"]["prompts"]
    assert f"no plan is proven to meet >= 50% of the full model's accuracy at budget 0.75 (95% confidence, " \
           f"{n} prompts)." in printed and "chosen:" not in printed
    assert not (out / "plan.json").exists() and data["choice"]["met"] is False
    best = next(p for p in data["points"] if p["key"] == data["choice"]["best_at_target"])
    v = best["floor"]
    assert best["of_full"] >= 0.5 and v["low"] < 0.5 <= v["high"]
    assert data["choice"]["best_at_target_verdict"] == v["verdict"] == "not enough prompts to tell"
    assert (f"pick, with that caveat: {best['label']} (budget {best['budget']:.3f}): {100 * best['of_full']:.1f}% of "
            f"full (95% CI {100 * v['low']:.1f}-{100 * v['high']:.1f}%), +{v['gained']}/-{v['lost']} of {n} prompts: "
            f"not enough prompts to tell; at these rates about {v['prompts_to_decide']} prompts would decide "
            f"(meets; --n {v['prompts_to_decide']})") in printed    # one task (the traffic file): --n counts its lines
    assert "cheapest plan meeting the floor: full model" in printed
