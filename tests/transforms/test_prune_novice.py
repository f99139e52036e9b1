"""`moetailor prune` of a novice plan: the checkpoint format stock vLLM 0.34 loads (approximate_experts,
approx_value constants, retained experts under their own ids), read back by moetailor's loader, and
generating exactly as the full model served with the novice plan (greedy, bundled model)."""
import json

import pytest
import torch
from safetensors import safe_open

from moetailor.calibration import calibrate_batches
from moetailor.cli.main import main
from moetailor.models.loading import load_model
from moetailor.plans.criteria import make_plan
from moetailor.plans.plan import Plan
from moetailor.serving import LLM, SamplingParams


@pytest.fixture(scope="module")
def novice(tmp_path_factory):
    root = tmp_path_factory.mktemp("novice")
    model = load_model("reference")
    g = torch.Generator().manual_seed(0)
    stats = calibrate_batches(model, [torch.randint(2, 8000, (4, 64), generator=g) for _ in range(2)], progress=False)
    stats_path = stats.save(root / "stats.safetensors")
    plan = make_plan(stats, model, "ean", keep=0.5, stats_path=str(stats_path), novice=True)
    plan_path = plan.save(root / "plan.json")
    assert main(["prune", "reference", str(plan_path), "--out", str(root / "pruned")]) == 0
    return root, Plan.load(plan_path), stats


def test_novice_checkpoint_has_vllm_expert_substitution_layout(novice):
    root, plan, stats = novice
    config = json.loads((root / "pruned" / "config.json").read_text())
    E = plan.model["num_experts"]
    assert config["num_experts"] == E                                  # routes over every logical expert
    replaced = {int(i): ids for i, ids in config["approximate_experts"].items()}
    for i, p in plan.decode.layers.items():
        assert replaced[i] == [e for e in range(E) if e not in p.keep]
    with safe_open(str(root / "pruned" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for i, ids in replaced.items():
            for e in range(E):
                stored = f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" in names
                constant = f"model.layers.{i}.mlp.experts.{e}.approx_value"
                assert stored == (e not in ids) and (constant in names) == (e in ids)
            e = ids[0]
            torch.testing.assert_close(f.get_tensor(f"model.layers.{i}.mlp.experts.{e}.approx_value"),
                                       stats.layers[i].mean_output[e].float())
        assert f"model.layers.{i}.mlp.gate.weight" in names and f.get_tensor(f"model.layers.{i}.mlp.gate.weight").shape[0] == E


def test_novice_checkpoint_generates_as_the_masked_full_model(novice):
    root, plan, _ = novice
    both = plan.with_phases(prefill=plan.decode, decode=plan.decode)      # a checkpoint holds both phases
    prompts = [torch.randint(2, 8000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 23, 11)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM("reference", both, max_num_seqs=4).generate(prompts, params)]
    pruned = LLM(str(root / "pruned"), max_num_seqs=4)
    assert pruned.plan is not None and pruned.plan.decode == both.decode
    got = [o.token_ids for o in pruned.generate(prompts, params)]
    assert got == want
    full = [o.token_ids for o in LLM("reference", max_num_seqs=4).generate(prompts, params)]
    assert full != want                                                   # the constants matter here


def test_novice_checkpoint_missing_a_constant_says_so(novice, tmp_path):
    import shutil

    from safetensors.torch import save_file

    root, _, _ = novice
    broken = tmp_path / "broken"
    shutil.copytree(root / "pruned", broken)
    with safe_open(str(broken / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dropped = next(k for k in tensors if k.endswith(".approx_value"))
    del tensors[dropped]
    save_file(tensors, str(broken / "model.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="stores no approx_value"):
        load_model(broken)
