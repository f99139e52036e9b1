"""load_model reads safetensors checkpoints tensor by tensor (plain reads, no memory map) into the same
model transformers' from_pretrained builds: every tensor, buffer, tie and the generation config."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from moetailor.models.loading import REFERENCE_DIR, load_model
from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys() and all(torch.equal(ba[k], bb[k]) for k in ba)
    assert (a.lm_head.weight is a.get_input_embeddings().weight) == (b.lm_head.weight is b.get_input_embeddings().weight)
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_sharded_checkpoint_loads_as_from_pretrained(arch, tmp_path):
    tiny_model(arch, num_experts=8, top_k=2).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_same_model(load_model(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_loads_as_from_pretrained(dtype):
    assert_same_model(load_model("reference", dtype=dtype), AutoModelForCausalLM.from_pretrained(REFERENCE_DIR, dtype=dtype))


def test_incomplete_checkpoint_is_one_clear_error(tmp_path):
    import json

    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="cannot read the weights"):
        load_model(tmp_path)
