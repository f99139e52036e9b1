"""`moetailor prune` of a merged plan: a stock checkpoint with fewer experts (config, router rows,
expert weights) that plain transformers loads, and that reproduces the model exactly where the merged
experts were identical."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moetailor.calibration import calibrate_batches
from moetailor.cli.main import main
from moetailor.eval.configurations import parse_configs
from moetailor.models.adapters import moe_layers
from moetailor.models.loading import load_model, model_fingerprint
from moetailor.plans.criteria import make_plan
from moetailor.plans.plan import Plan
from moetailor.routing import RoutingController
from moetailor.routing.policy import LayerPolicy, PhasePolicy
from moetailor.serving import LLM, SamplingParams
from moetailor.transforms import read_sidecar


@pytest.fixture(scope="module")
def identical(tmp_path_factory):
    """`reference` in float32 with experts 2g+1 made copies of 2g (weights and router rows), saved."""
    root = tmp_path_factory.mktemp("identical")
    model = load_model("reference", dtype=torch.float32)
    with torch.no_grad():
        for layer in moe_layers(model):
            ex = layer.experts
            ex.gate_up_proj[1::2] = ex.gate_up_proj[0::2]
            ex.down_proj[1::2] = ex.down_proj[0::2]
            layer.router.weight[1::2] = layer.router.weight[0::2]
    model.save_pretrained(root / "src")
    from moetailor.models.loading import resolve_model_path
    from moetailor.transforms.artifacts import copy_tokenizer
    copy_tokenizer(resolve_model_path("reference"), root / "src")
    return root, load_model(root / "src", dtype=torch.float32)


@pytest.mark.parametrize("router", ["dominant", "weighted"])
def test_merging_identical_experts_reproduces_the_model(identical, router):
    root, model = identical
    fp = model_fingerprint(model)
    E = fp["num_experts"]
    groups = tuple(((2 * g, 0.7), (2 * g + 1, 0.3)) for g in range(E // 2))
    merge = LayerPolicy(keep=tuple(range(0, E, 2)), pool_mode="merge", merge=groups, merge_router=router)
    plan = Plan(model=fp, decode=PhasePolicy.uniform(fp["moe_layers"], merge))
    plan_path = plan.save(root / f"plan-{router}.json")
    out = root / f"merged-{router}"
    assert main(["prune", str(root / "src"), str(plan_path), "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)          # stock transformers
    assert merged.config.num_experts == E // 2 and json.loads((out / "config.json").read_text())["num_experts"] == E // 2
    masked = PhasePolicy.uniform(fp["moe_layers"], LayerPolicy(keep=tuple(range(0, E, 2))))
    ids = torch.randint(2, 8000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RoutingController.of(model).policy(masked):
        want = model(input_ids=ids).logits
    got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    side = read_sidecar(out)
    assert side["num_experts_kept"] == E // 2 and side["merged"][str(fp["moe_layers"][0])][0] == [[0, 1], [0.7, 0.3]]


def test_merging_different_experts_changes_the_output(identical):
    """The check above can fail: merging experts that differ moves the logits."""
    root, model = identical
    fp = model_fingerprint(model)
    E = fp["num_experts"]
    groups = tuple(((g, 0.5), (g + E // 2, 0.5)) for g in range(E // 2))   # 0 with 32: not copies
    plan = Plan(model=fp, decode=PhasePolicy.uniform(fp["moe_layers"], LayerPolicy(
        keep=tuple(range(E // 2)), pool_mode="merge", merge=groups, merge_router="dominant")))
    out = root / "merged-different"
    assert main(["prune", str(root / "src"), str(plan.save(root / "plan-different.json")), "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    masked = PhasePolicy.uniform(fp["moe_layers"], LayerPolicy(keep=tuple(range(E // 2))))
    ids = torch.randint(2, 8000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), RoutingController.of(model).policy(masked):
        want = model(input_ids=ids).logits
    assert (merged(input_ids=ids).logits - want).abs().max() > 1e-2


@pytest.fixture(scope="module")
def hcsmoe(tmp_path_factory):
    root = tmp_path_factory.mktemp("hcsmoe")
    model = load_model("reference")
    g = torch.Generator().manual_seed(0)
    stats = calibrate_batches(model, [torch.randint(2, 8000, (4, 64), generator=g) for _ in range(2)], progress=False)
    stats_path = stats.save(root / "stats.safetensors")
    assert main(["plan", str(stats_path), "--model", "reference", "--merge", "hcsmoe", "--keep", "0.5",
                 "--out", str(root / "plan.json")]) == 0
    assert main(["prune", "reference", str(root / "plan.json"), "--out", str(root / "merged")]) == 0
    return root, model


def test_hcsmoe_checkpoint_loads_in_stock_transformers_and_the_engine(hcsmoe):
    root, model = hcsmoe
    merged = AutoModelForCausalLM.from_pretrained(root / "merged")
    layer = moe_layers(merged)[0]
    H = model.config.hidden_size
    assert merged.config.num_experts == 32 and tuple(layer.router.weight.shape) == (32, H)
    assert layer.experts.gate_up_proj.shape[0] == 32 and layer.experts.down_proj.shape[0] == 32
    plan = Plan.load(root / "plan.json")
    i = plan.model["moe_layers"][0]
    g = plan.decode.for_layer(i).merge_groups()[1]        # a merged expert = the weighted sum of its members
    want = sum(w * moe_layers(model)[0].experts.down_proj[e].float() for e, w in zip(*g))
    torch.testing.assert_close(layer.experts.down_proj[1].float(), want.to(torch.bfloat16).float())
    out = LLM(str(root / "merged"), max_num_seqs=2).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6


def test_eval_serves_a_merged_plan_on_its_merged_checkpoint(hcsmoe, tmp_path, monkeypatch):
    root, model = hcsmoe
    monkeypatch.setenv("MOETAILOR_CACHE", str(tmp_path))
    plan = Plan.load(root / "plan.json")
    served = parse_configs("phase-aware")[0].build(model, plan)
    assert served.decode_model and (tmp_path / "merged") in __import__("pathlib").Path(served.decode_model).parents
    assert served.plan.decode.is_identity and served.plan.prefill.is_identity
    assert AutoModelForCausalLM.from_pretrained(served.decode_model).config.num_experts == 32
    with pytest.raises(ValueError, match="merged checkpoint itself"):
        parse_configs("pruned")[0].build(model, plan)


def test_gguf_export_of_a_merge_plan_names_the_merged_checkpoint(hcsmoe):
    from moetailor.transforms.gguf import gguf_plan

    root, _ = hcsmoe
    with pytest.raises(ValueError, match="write the merged checkpoint"):
        gguf_plan(Plan.load(root / "plan.json"))


def _converter_available() -> bool:
    from moetailor.transforms.gguf import converter_dir

    try:
        converter_dir()
        return True
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _converter_available(), reason="llama.cpp's converter is not installed: `make setup-llamacpp`")
def test_a_merged_qwen3_checkpoint_exports_to_gguf(tmp_path):
    model = load_model("reference-qwen3")
    g = torch.Generator().manual_seed(0)
    stats = calibrate_batches(model, [torch.randint(2, 8000, (4, 64), generator=g) for _ in range(2)], progress=False)
    plan = make_plan(stats, model, "frequency", keep=0.5, merge="hcsmoe").save(tmp_path / "plan.json")
    assert main(["prune", "reference-qwen3", str(plan), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", "gguf", str(tmp_path / "merged"), "--out", str(tmp_path / "m.gguf")]) == 0
    from moetailor.transforms.gguf import import_converter
    import_converter()
    import gguf

    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(tmp_path / "m.gguf")).fields.items()}
    assert kv["qwen3moe.expert_count"] == 32


def test_merging_aligns_neurons_before_averaging():
    """Two copies of one expert whose intermediate neurons are numbered differently compute the same
    function; merged, they give that function back (a plain average of the unaligned weights does not)."""
    from moetailor.transforms.merge import merge_experts

    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g), torch.randn(16, 48, generator=g)
    perm = torch.randperm(48, generator=g)
    copy = (gate[perm], up[perm], down[:, perm])

    def expert(w, x):
        return (torch.nn.functional.silu(x @ w[0].T) * (x @ w[1].T)) @ w[2].T
    x = torch.randn(5, 16, generator=g)
    torch.testing.assert_close(expert(copy, x), expert((gate, up, down), x))
    merged = merge_experts([(gate, up, down), copy], (0.5, 0.5))
    torch.testing.assert_close(expert(merged, x), expert((gate, up, down), x))
    plain = tuple(0.5 * a + 0.5 * b for a, b in zip((gate, up, down), copy))
    assert (expert(plain, x) - expert((gate, up, down), x)).abs().max() > 0.1
