"""`moetailor generate` on a saved tiny checkpoint: full prefill + planned decode, errors exit 2."""
from __future__ import annotations

from engine_helpers import char_tokenizer

from moetailor.cli.main import main
from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams


def test_generate_prints_the_engine_output_with_a_decode_plan(tmp_path, capsys):
    model = tiny_model("qwen2_moe", vocab=128, seed=8)
    tok = char_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    plan = uniform_plan(model, decode=LayerPolicy(keep=(1, 3, 4)), prefill=LayerPolicy(keep=(0, 1)))
    plan.save(tmp_path / "plan.json")
    rc = main(["generate", str(tmp_path / "m"), "--prompt", "hello", "--max-tokens", "6", "--ignore-eos",
               "--decode-plan", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0
    # --decode-plan keeps the full router for prefill: the plan's prefill policy is not applied
    expected = LLM(model, plan.with_phases(decode=plan.decode), tokenizer=tok).generate(
        ["hello"], SamplingParams(max_tokens=6, ignore_eos=True))[0].text
    assert f"--- prompt: 'hello'\n{expected}\n" in out
    assert "decode tokens/s" in out


def test_generate_reports_bad_input_and_exits_2(tmp_path, capsys):
    model = tiny_model("qwen2_moe", vocab=128)
    model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    rc = main(["generate", str(tmp_path / "m"), "--prompt", "x" * 40, "--max-model-len", "32"])
    assert rc == 2 and "context limit of 32" in capsys.readouterr().err
    rc = main(["generate", str(tmp_path / "m"), "--prompt", "x", "--decode-plan", str(tmp_path / "missing.json")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
