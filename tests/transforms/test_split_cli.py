"""`moetailor split` on a tiny checkpoint: writes a loadable split with a sidecar, the gate
fine-tuning lowers its KL, and bad input exits 2 with a clear message."""
import pytest

from moetailor.cli.main import main
from moetailor.models import moe_layers
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.transforms.split import read_split_sidecar


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("split-cli") / "model"
    tiny_model("qwen2_moe", num_experts=8, top_k=2, expert_width=16).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_split_cli_finetune(src, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "split"
    args = ["split", str(src), "--parts", "2", "--data", "text:fortunes", "--out", str(out), "--tokens", "400",
            "--seq-len", "64", "--anneal-steps", "100", "--gate", "finetune", "--finetune-steps", "8"]
    assert main(args) == 0
    assert "split checkpoint" in capsys.readouterr().out
    side = read_split_sidecar(out)
    assert side["parts"] == 2 and side["gate"] == "finetune" and side["meta"]["finetune"]["steps"] == 8
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert moe_layers(model)[0].num_experts == 16 and model.config.num_experts_per_tok == 4
    assert (out / "tokenizer.json").exists()
    # the engine learns the parts from the loaded model: a budget above 2 x 2 is refused, naming them
    from moetailor.serving import LLM, SamplingParams
    llm = LLM(str(out))
    assert llm.model.moetailor_sidecars.split.parts == 2
    with pytest.raises(ValueError, match=r"1\.\.4 .*2 sub-experts x 2 experts"):
        llm.add_request([1, 2, 3], SamplingParams(max_tokens=1, expert_top_k=5))
    assert main(args) == 2                                              # exists, no --overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_split_cli_bad_parts(src, tmp_path, capsys):
    assert main(["split", str(src), "--parts", "3", "--data", "text", "--out", str(tmp_path / "x"), "--tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert "does not divide the expert width 16" in err
    assert not (tmp_path / "x").exists()
