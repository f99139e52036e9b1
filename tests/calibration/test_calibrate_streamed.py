"""Layer-streamed calibration of a sharded checkpoint equals the in-memory calibration."""
import pytest
import torch

from moetailor.calibration import calibrate
from moetailor.calibration.calibrate import calibration_record
from moetailor.calibration.streaming import calibrate_streamed
from moetailor.models.tiny import TINY_ARCHITECTURES, char_tokenizer, tiny_model


def save_sharded(model, path):
    model.save_pretrained(path, max_shard_size="40KB")
    char_tokenizer().save_pretrained(path)
    model.moetailor_source = str(path)
    return path


def assert_same_stats(a, b, rtol):
    assert a.model == b.model
    assert a.meta["tokens"] == b.meta["tokens"]
    for i in a.layers:
        ta, tb = a.layers[i].tensors(), b.layers[i].tensors()
        assert ta.keys() == tb.keys()
        for name in ta:
            assert torch.allclose(ta[name], tb[name], rtol=rtol, atol=rtol * float(tb[name].abs().max() + 1e-12)), \
                (i, name, float((ta[name] - tb[name]).abs().max()))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_streamed_calibration_equals_in_memory(arch, tmp_path):
    model = tiny_model(arch, num_experts=8, top_k=2, layers=3)
    path = save_sharded(model, tmp_path / "m")
    tok = char_tokenizer()
    kw = dict(seed=1, batch_tokens=256, seq_len=64, fold=True, progress=False)
    want = calibrate(model, tok, "text", 1024, **kw)
    got = calibrate_streamed(path, tok, "text", 1024, dtype=torch.float32, **kw)
    assert got.meta["streamed"] is True
    assert calibration_record(got.meta) == calibration_record(want.meta)   # same data name, tokens, content hash
    assert_same_stats(got, want, rtol=1e-5)
    assert got.layers[0].frequency.sum() == 1024 * 2


def test_streamed_calibration_spills_activations_to_disk(tmp_path):
    model = tiny_model("olmoe", num_experts=8, top_k=2)
    path = save_sharded(model, tmp_path / "m")
    tok = char_tokenizer()
    kw = dict(seed=0, batch_tokens=128, seq_len=32, progress=False)
    memory = calibrate_streamed(path, tok, "text", 512, dtype=torch.float32, **kw)
    spilled = calibrate_streamed(path, tok, "text", 512, dtype=torch.float32, spill_dir=tmp_path / "spill",
                                 spill_bytes=0, **kw)
    assert_same_stats(spilled, memory, rtol=0)
    assert not list((tmp_path / "spill").iterdir())        # the spill files are removed afterwards


def test_streamed_bf16_calibration_is_close_to_in_memory_bf16(tmp_path):
    from moetailor.models import load_model

    path = save_sharded(tiny_model("qwen3_moe", num_experts=8, top_k=2).to(torch.bfloat16), tmp_path / "m")
    model = load_model(path, dtype=torch.bfloat16)
    tok = char_tokenizer()
    kw = dict(seed=0, batch_tokens=128, seq_len=32, progress=False)
    want = calibrate(model, tok, "text", 512, **kw)
    got = calibrate_streamed(path, tok, "text", 512, **kw)      # the stored dtype: bf16
    assert got.meta["dtype"] == "bfloat16" == want.meta["dtype"]
    assert_same_stats(got, want, rtol=2e-2)


def test_cli_workflow_on_a_synthetic_checkpoint(tmp_path, capsys):
    """synth -> calibrate (streamed) -> plan -> prune (streamed) -> eval --metric kl, from the CLI."""
    import json

    from moetailor.cli.main import main
    from moetailor.transforms.synthetic import write_synthetic

    model = write_synthetic("qwen3-30b-a3b", tmp_path / "m", layers=2, shard_bytes=200_000, progress=False,
                            hidden_size=64, moe_intermediate_size=32, intermediate_size=64, vocab_size=8192,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16)
    stats, plan, pruned = tmp_path / "s.safetensors", tmp_path / "p.json", tmp_path / "pruned"
    assert main(["calibrate", str(model), "--stream", "on", "--data", "text", "--tokens", "2048", "--batch-tokens",
                 "512", "--seq-len", "128", "--out", str(stats)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "layer-streamed, bfloat16, peak RSS" in printed
    assert main(["plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--model", str(model),
                 "--out", str(plan)]) == 0
    assert main(["prune", str(model), str(plan), "--out", str(pruned)]) == 0
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(pruned).num_experts == 8
    assert main(["eval", str(model), "--metric", "kl", "--pruned", str(pruned), "--kl-docs", "1", "--kl-window",
                 "64", "--out", str(tmp_path / "kl")]) == 0
    assert json.loads((tmp_path / "kl" / "kl.json").read_text())["kl"] > 0
