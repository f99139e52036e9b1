"""The streamed pruner (one tensor at a time from shards) writes the same checkpoint as the in-memory
pruner: it loads in stock transformers and equals the masked full model."""
import json

import pytest
import torch
from safetensors.torch import load_file
from test_prune import KEEP, max_diff_from_masked

from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.transforms import prune_checkpoint, read_sidecar
from moetailor.transforms.streaming import prune_checkpoint_streamed


def all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_streamed_prune_of_a_sharded_checkpoint_equals_masked_model(arch, tmp_path):
    model = tiny_model(arch, num_experts=8, top_k=2)
    full = tmp_path / "full"
    model.save_pretrained(full, max_shard_size="40KB")
    assert (full / "model.safetensors.index.json").is_file()
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    plan_path = plan.save(tmp_path / "plan.json")
    out = prune_checkpoint_streamed(full, plan_path, tmp_path / "streamed", shard_bytes=30_000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert max_diff_from_masked(out, model, plan.decode) <= 1e-5
    # the same tensors as the in-memory pruner writes from the loaded model
    in_memory = prune_checkpoint(model, plan, tmp_path / "in-memory")
    a, b = all_tensors(out), all_tensors(in_memory)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_sidecar(out)["kept"] == read_sidecar(in_memory)["kept"]
    assert read_sidecar(out)["source_model"]["router_hash"] == read_sidecar(in_memory)["source_model"]["router_hash"]


def test_prune_cli_streams(tmp_path):
    from moetailor.cli.main import main

    model = tiny_model("olmoe", num_experts=8, top_k=2)
    model.save_pretrained(tmp_path / "full", max_shard_size="40KB")
    uniform_plan(model, decode=LayerPolicy(keep=KEEP)).save(tmp_path / "plan.json")
    assert main(["prune", str(tmp_path / "full"), str(tmp_path / "plan.json"), "--out", str(tmp_path / "p")]) == 0
    assert read_sidecar(tmp_path / "p").get("streamed") is True
