"""Expert output statistics (largest |output|, mean output, output variance) against a direct
hooked computation on tiny models, and statistics files written before they were recorded."""
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from moetailor.calibration import ExpertStats, calibrate_batches
from moetailor.models import moe_layers
from moetailor.models.tiny import tiny_model


def batches(n=3, seed=0, shape=(4, 16)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, shape, generator=g) for _ in range(n)]


def hooked_outputs(model, inputs):
    """Per MoE layer and expert, the down projection's outputs on the tokens the stock router sent it,
    computed from the raw weights inside a forward hook on the router."""
    outs = {}
    hooks = []
    for layer in moe_layers(model):
        def hook(module, args, out, layer=layer):
            hidden, index = args[0].reshape(-1, args[0].shape[-1]), out[2]
            ex = layer.experts
            for t in range(index.shape[0]):
                for e in index[t].tolist():
                    gate, up = (hidden[t] @ ex.gate_up_proj[e].T).chunk(2)
                    y = ex.down_proj[e] @ (F.silu(gate) * up)
                    outs.setdefault(layer.index, {}).setdefault(e, []).append(y.detach().double())
        hooks.append(layer.router.register_forward_hook(hook))
    with torch.no_grad():
        for x in inputs:
            model(input_ids=x, use_cache=False)
    for h in hooks:
        h.remove()
    return outs


@pytest.mark.parametrize("all_experts", [False, True])
def test_output_statistics_match_hooked_computation(all_experts):
    model = tiny_model("qwen3_moe", num_experts=8, top_k=2)
    inputs = batches()
    want = hooked_outputs(model, inputs)
    stats = calibrate_batches(model, inputs, progress=False, all_experts=all_experts)
    assert stats.has_outputs
    for i, per_expert in want.items():
        st = stats.layers[i]
        for e in range(st.num_experts):
            ys = torch.stack(per_expert[e]) if e in per_expert else torch.zeros(0, st.out_sum.shape[1], dtype=torch.float64)
            if not len(ys):
                assert float(st.out_max[e]) == 0 and float(st.out_sq[e]) == 0
                continue
            assert float(st.out_max[e]) == pytest.approx(float(ys.abs().max()), rel=1e-4)
            torch.testing.assert_close(st.out_sum[e], ys.sum(0), rtol=1e-4, atol=1e-5)
            assert float(st.out_sq[e]) == pytest.approx(float(ys.pow(2).sum()), rel=1e-4)
            torch.testing.assert_close(st.mean_output[e], ys.mean(0), rtol=1e-4, atol=1e-5)
            var = float((ys - ys.mean(0)).pow(2).sum(-1).mean())
            assert float(st.output_variance[e]) == pytest.approx(var, rel=1e-3, abs=1e-6)


def test_statistics_written_before_outputs_still_load(tmp_path):
    model = tiny_model("qwen2_moe")
    stats = calibrate_batches(model, batches(1), progress=False)
    path = stats.save(tmp_path / "new.safetensors")
    with safe_open(str(path), framework="pt") as f:   # rewrite it as an older moetailor wrote it
        meta = f.metadata()
        old = {k: f.get_tensor(k) for k in f.keys() if not k.split(".", 1)[1].startswith("out_")}
    save_file(old, str(tmp_path / "old.safetensors"), metadata=meta)
    loaded = ExpertStats.load(tmp_path / "old.safetensors")
    assert not loaded.has_outputs
    torch.testing.assert_close(loaded.layers[1].reap, stats.layers[1].reap)
    with pytest.raises(ValueError, match="re-run `moetailor calibrate`"):
        loaded.require_outputs("--novice")
    with pytest.raises(ValueError, match="re-run `moetailor calibrate`"):
        loaded.layers[1].mean_output
    again = ExpertStats.load(path)
    assert again.has_outputs
    torch.testing.assert_close(again.layers[1].out_sum, stats.layers[1].out_sum)
