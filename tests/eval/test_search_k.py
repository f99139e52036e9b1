"""search-k: coordinate descent over per-layer k on tiny models (and the CLI end to end)."""
import json

import pytest
import torch

from moetailor.eval.search_k import search_k, uniform_allocation
from moetailor.models import moe_layers
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans import Plan
from moetailor.plans.techniques import Shape

K = 4


def layer_ks(policy, shape):
    """The active-expert count per MoE layer a policy's ``top_k`` fields give."""
    return [policy.for_layer(i).top_k or shape.top_k for i in shape.layers]


def windows(n=6, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 96, (n, length), generator=g).tolist()


def silenced(layers_off):
    """A 3-layer model whose routed experts in ``layers_off`` output zero: k there cannot matter."""
    model = tiny_model("qwen2_moe", seed=2, num_experts=8, top_k=K, layers=3)
    with torch.no_grad():
        for layer in moe_layers(model):
            if layer.index in layers_off:
                layer.experts.down_proj.zero_()
    return model


def test_uniform_allocation_and_budget_errors():
    shape = Shape((0, 1, 2), 8, K)
    assert uniform_allocation(shape, 6) == [2, 2, 2]
    assert uniform_allocation(shape, 7) == [2, 2, 3]
    assert uniform_allocation(shape, 11) == [3, 4, 4]
    for bad in (2, 13):
        with pytest.raises(ValueError, match=r"choose a budget in \[3, 12\]"):
            uniform_allocation(shape, bad)


def test_search_moves_experts_to_the_layer_that_matters():
    model = silenced({0, 2})
    result = search_k(model, windows(), budget=6, tol=0.0, progress=False, log=lambda m: None)
    assert result.uniform == [2, 2, 2]
    assert result.ks == [1, 4, 1]
    assert sum(result.ks) == 6
    assert result.kl < 1e-6 < result.uniform_kl
    assert result.rounds == len(result.history) == 2
    assert result.evaluations <= 1 + result.rounds * 6 + 6


def test_search_never_worsens_and_respects_bounds():
    model = tiny_model("qwen2_moe", seed=4, num_experts=8, top_k=K, layers=3)
    result = search_k(model, windows(seed=1), budget=5, phase="decode", max_rounds=3, progress=False,
                      log=lambda m: None)
    assert sum(result.ks) == 5 and all(1 <= k <= K for k in result.ks)
    assert result.kl <= result.uniform_kl
    assert result.rounds <= 3
    with pytest.raises(ValueError, match="unknown phase"):
        search_k(model, windows(), budget=5, phase="middle", progress=False)


def test_cli_writes_a_plan_with_the_search_record(tmp_path, capsys):
    from moetailor.cli.main import main

    model_dir = tmp_path / "tiny"
    model = tiny_model("qwen2_moe", seed=5, num_experts=8, top_k=K, layers=3, vocab=98)
    model.save_pretrained(model_dir)
    char_tokenizer(98).save_pretrained(model_dir)
    out = tmp_path / "plan.json"
    argv = ["search-k", str(model_dir), "--budget", "6", "--out", str(out), "--tokens", "96", "--window", "16",
            "--data", "text", "--max-rounds", "2"]
    assert main(argv) == 0
    plan = Plan.load(out)
    shape = Shape.of(model)
    ks = layer_ks(plan.decode, shape)
    assert sum(ks) == 6 and layer_ks(plan.prefill, shape) == ks
    search = plan.meta["search"]
    assert search["search"]["ks"] == ks and "heldout" in search and search["method"].startswith("coordinate descent")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ks"] == ks
    assert main(argv) == 2                                   # exists: refuses to overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(argv[:2] + ["--budget", "99", "--out", str(tmp_path / "b.json")] + argv[6:]) == 2
    assert "choose a budget in [3, 12]" in capsys.readouterr().err


def test_pool_search_moves_pool_slots_to_the_layer_that_needs_them(tmp_path, capsys):
    """Layer 1's experts are silenced, so its pool cannot matter: the search moves pool slots out of
    it into layers whose pool changes the output; the total and the bounds [k, E] hold."""
    from moetailor.calibration import calibrate
    from moetailor.cli.main import main

    model = silenced({1})
    tok = char_tokenizer()
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    stats = calibrate(model, tok, "text", 512, batch_tokens=128, seq_len=64, progress=False)
    stats.save(tmp_path / "stats.safetensors")
    out = tmp_path / "plan.json"
    assert main(["plan", str(tmp_path / "stats.safetensors"), "--criterion", "frequency", "--keep", "0.75",
                 "--layers", "search", "--model", str(model_dir), "--search-data", "text", "--search-tokens", "256",
                 "--step", "1", "--out", str(out)]) == 0
    plan = Plan.load(out)
    sizes = [len(plan.decode.for_layer(i).keep) for i in (0, 1, 2)]
    assert sum(sizes) == 18 and all(K <= s <= 8 for s in sizes) and not plan.prefill.layers
    assert sizes[1] < 6 and sizes != [6, 6, 6]
    search = plan.meta["pool_search"]["search"]
    assert search["ks"] == sizes and search["kl"] < search["uniform_kl"]
    assert "searched" in capsys.readouterr().out
    assert main(["plan", str(tmp_path / "stats.safetensors"), "--criterion", "frequency", "--keep", "0.75",
                 "--layers", "search", "--out", str(tmp_path / "x.json")]) == 2
    assert "--model" in capsys.readouterr().err


def test_pool_search_scores_novice_pools_as_they_serve(tmp_path, capsys):
    """With --novice the search measures each allocation with the dropped experts' constants added (the
    uniform start's KL equals the engine's held-out KL of that novice plan, not the masked one's), and
    writes a novice plan; --merge is refused there with the reason."""
    from moetailor.calibration import calibrate
    from moetailor.cli.main import main
    from moetailor.eval.backends import EngineBackend
    from moetailor.eval.search_k import calibration_windows
    from moetailor.plans.criteria import make_plan

    model = tiny_model("qwen2_moe", seed=2, num_experts=8, top_k=K, layers=3)
    tok = char_tokenizer()
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    stats = calibrate(model, tok, "text", 512, batch_tokens=128, seq_len=64, progress=False)
    stats_path = tmp_path / "stats.safetensors"
    stats.save(stats_path)
    out = tmp_path / "plan.json"
    argv = ["plan", str(stats_path), "--criterion", "mone", "--keep", "0.75", "--layers", "search", "--novice",
            "--model", str(model_dir), "--search-data", "text", "--search-tokens", "256", "--step", "1"]
    assert main(argv + ["--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.needs_constants and sum(len(plan.decode.for_layer(i).keep) for i in (0, 1, 2)) == 18
    search = plan.meta["pool_search"]
    assert search["novice"] is True
    backend = EngineBackend(model, tok)
    windows = calibration_windows(tok, "text", 256, 128)
    uniform = {i: 6 for i in (0, 1, 2)}
    novice = make_plan(stats, model, "mone", layers=uniform, stats_path=str(stats_path), novice=True)
    masked = make_plan(stats, model, "mone", layers=uniform, stats_path=str(stats_path))
    novice_kl = backend.heldout(novice.with_phases(None, novice.decode), windows).kl
    masked_kl = backend.heldout(masked.with_phases(None, masked.decode), windows).kl
    assert search["search"]["uniform_kl"] == pytest.approx(novice_kl, rel=1e-5)
    assert abs(novice_kl - masked_kl) > 1e-4
    assert main(argv + ["--merge", "msmoe", "--out", str(tmp_path / "m.json")]) == 2
    assert "does not take --merge" in capsys.readouterr().err
