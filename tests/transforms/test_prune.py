"""Pruned checkpoints equal the masked full model, shrink as expected, load in stock transformers,
and bad plans or outputs are refused."""
import subprocess
import sys
import textwrap

import pytest
import torch

from moetailor.models import arch_spec, moe_layers
from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy, PhasePolicy, RoutingController
from moetailor.transforms import SIDECAR, prune_checkpoint, read_sidecar


def masked_logits(model, policy: PhasePolicy, x):
    ctl = RoutingController(model)
    try:
        with torch.no_grad(), ctl.policy(policy):
            return model(input_ids=x, use_cache=False).logits
    finally:
        ctl.remove()


def load_stock(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def max_diff_from_masked(out, model, policy: PhasePolicy) -> float:
    """Largest logit difference between the stock checkpoint at ``out`` and ``model`` masked by ``policy``."""
    pruned = load_stock(out)
    x = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = pruned(input_ids=x, use_cache=False).logits
    return float((got - masked_logits(model, policy, x)).abs().max())


def weight_bytes(path):
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


KEEP = (0, 2, 3, 6)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_pruned_checkpoint_equals_masked_model(arch, tmp_path):
    model = tiny_model(arch, num_experts=8, top_k=2)
    full_dir = tmp_path / "full"
    model.save_pretrained(full_dir)
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    out = prune_checkpoint(model, plan, tmp_path / "pruned")
    assert max_diff_from_masked(out, model, plan.decode) <= 1e-5
    # a wrong mask (another kept set) computes another function
    wrong = PhasePolicy.uniform([l.index for l in moe_layers(model)], LayerPolicy(keep=(1, 2, 3, 6)))
    assert max_diff_from_masked(out, model, wrong) > 1e-3
    # the checkpoint lost exactly the dropped experts' weights and router rows
    layers = moe_layers(model)
    dropped = 8 - len(KEEP)
    per_layer = layers[0].expert_bytes() + layers[0].router.weight[0].numel() * 4
    if arch == "deepseek_v3":
        per_layer += 4  # e_score_correction_bias entry
    expected = weight_bytes(full_dir) - len(layers) * dropped * per_layer
    assert abs(weight_bytes(out) - expected) < 4096  # safetensors header differences only
    side = read_sidecar(out)
    assert side["kept"] == {str(l.index): list(KEEP) for l in layers}
    assert side["num_experts_original"] == 8 and side["num_experts_kept"] == 4
    from transformers import AutoConfig
    config, pruned = AutoConfig.from_pretrained(out), load_stock(out)
    assert arch_spec(config).num_experts(config) == 4 == len(moe_layers(pruned)[0].router.weight)
    if arch == "deepseek_v3":
        bias = moe_layers(pruned)[0].router.e_score_correction_bias
        assert torch.equal(bias, layers[0].router.e_score_correction_bias[list(KEEP)])


def test_stock_transformers_loads_without_moetailor(tmp_path):
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    out = prune_checkpoint(model, plan, tmp_path / "pruned")
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    want = masked_logits(model, plan.decode, x)
    torch.save({"x": x, "want": want}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, local_files_only=True).eval()
        io = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.no_grad():
            got = m(input_ids=io["x"], use_cache=False).logits
        assert not any(k.startswith("moetailor") for k in sys.modules), "moetailor was imported"
        print("maxdiff", float((got - io["want"]).abs().max()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split("maxdiff")[1]) <= 1e-5


def test_deepseek_groups(tmp_path):
    model = tiny_model("deepseek_v3", num_experts=8, top_k=2, n_group=2, topk_group=1)
    good = uniform_plan(model, decode=LayerPolicy(keep=(0, 3, 4, 6)))  # two per group of four
    out = prune_checkpoint(model, good, tmp_path / "ok")
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = load_stock(out)(input_ids=x, use_cache=False).logits
    assert (got - masked_logits(model, good.decode, x)).abs().max() <= 1e-5
    bad = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 6)))
    with pytest.raises(ValueError, match="same count in every group"):
        prune_checkpoint(model, bad, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_refusals(tmp_path):
    model = tiny_model("olmoe", num_experts=8, top_k=2)
    layers = [l.index for l in moe_layers(model)]
    uneven = uniform_plan(model).with_phases(decode=PhasePolicy({layers[0]: LayerPolicy(keep=(0, 1, 2, 3)),
                                                                 layers[1]: LayerPolicy(keep=(0, 1, 2))}))
    with pytest.raises(ValueError, match="keeps 4/3 of 8 experts per layer: different expert counts.*--decode-plan PLAN"):
        prune_checkpoint(model, uneven, tmp_path / "a")
    partial = uniform_plan(model).with_phases(decode=PhasePolicy({layers[0]: LayerPolicy(keep=(0, 1, 2, 3))}))
    with pytest.raises(ValueError, match="different expert counts"):
        prune_checkpoint(model, partial, tmp_path / "a")
    with pytest.raises(ValueError, match="prunes no experts"):
        prune_checkpoint(model, uniform_plan(model, prefill=LayerPolicy(keep=(0, 1, 2, 3))), tmp_path / "a")
    with pytest.raises(ValueError, match="cannot hold"):
        prune_checkpoint(model, uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3), top_k=1)), tmp_path / "a")
    with pytest.raises(ValueError, match="does not match the model"):
        prune_checkpoint(tiny_model("olmoe", seed=9), uniform_plan(model, decode=LayerPolicy(keep=KEEP)), tmp_path / "a")
    assert not (tmp_path / "a").exists()
    assert not list(tmp_path.glob(".a.tmp*"))
    # an existing output is refused without --overwrite and replaced with it
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        prune_checkpoint(model, plan, tmp_path / "out")
    with pytest.raises(ValueError, match="moetailor did not write"):   # a folder of the user's own files
        prune_checkpoint(model, plan, tmp_path / "out", overwrite=True)
    (tmp_path / "out" / ".moetailor-output").write_text("{}")        # an earlier output of moetailor's
    prune_checkpoint(model, plan, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / SIDECAR).exists() and not (tmp_path / "out" / "stale.txt").exists()
    # the prefill phase can be written too
    both = uniform_plan(model, prefill=LayerPolicy(keep=(1, 2, 5)))
    out = prune_checkpoint(model, both, tmp_path / "pre", phase="prefill")
    assert read_sidecar(out)["kept"][str(layers[0])] == [1, 2, 5]
