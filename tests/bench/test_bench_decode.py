"""Decode/SLO/prefill benchmarks end to end on a tiny model (counts and wiring, never timings)."""
import pytest
import torch

from moetailor.bench.decode import DecodeConfig, _goals, _plots, _tables, measure_model
from moetailor.bench.pools import kept_ids, make_pools, mask_plan, pruned_model
from moetailor.bench.report import Report
from moetailor.bench.slo import _report_model, throughput_at_slo
from moetailor.bench.synthetic import synthetic_config
from moetailor.routing.traffic import expected_distinct
from moetailor.models.tiny import tiny_model


def test_pruned_pool_equals_masked_pool():
    from moetailor.routing import RoutingController

    model = tiny_model("olmoe", num_experts=8, top_k=2)
    pruned = pruned_model(model, 0.5)
    assert pruned.config.num_experts == 4
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = pruned(ids).logits
        ctl = RoutingController(model)
        with ctl.policy(mask_plan(model, 0.5).decode):
            got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_kept_ids_and_pools():
    assert len(kept_ids(64, 0.25, 8)) == 16
    assert len(kept_ids(8, 0.1, 2)) == 2                              # never fewer than k
    assert kept_ids(64, 0.5, 8) == kept_ids(64, 0.5, 8)               # seeded
    with pytest.raises(ValueError, match="keep"):
        kept_ids(64, 1.5, 8)
    model = tiny_model("olmoe", num_experts=8, top_k=2)
    pools = make_pools(model, [0.5], pruned=False, top_ks=[1])
    assert [p.label for p in pools] == ["full", "mask 50%", "k'=1"]
    with pytest.raises(ValueError, match="top-k"):
        make_pools(model, [], pruned=False, top_ks=[3])


def test_synthetic_config_shapes():
    cfg = synthetic_config(layers=2)
    assert (cfg.hidden_size, cfg.num_experts, cfg.intermediate_size, cfg.num_experts_per_tok) == (2048, 64, 1024, 8)
    pool = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size * 4
    assert pool >= 2e9                                                # well above the 300 MiB L3
    with pytest.raises(ValueError):
        synthetic_config(layers=0)


def test_decode_measures_traffic_on_tiny_model(tmp_path):
    torch.manual_seed(0)
    model = tiny_model("olmoe", num_experts=8, top_k=2)
    cfg = DecodeConfig(model="tiny", batches=[1, 4], keeps=[0.5], top_ks=[1], steps=3, hf=True, pruned=True)
    measured, hf = measure_model("tiny", cfg, model=model)
    assert set(hf) == {1, 4} and all(v > 0 for v in hf.values())
    labels = {m.pool.label for m in measured}
    assert labels == {"full", "mask 50%", "pruned 50%", "k'=1"}
    per_expert = 3 * 32 * 16 * 4
    for m in measured:
        r, p = m.result, m.pool
        assert r.steps >= 1 and r.step_s > 0
        assert 1 <= r.distinct <= p.experts                           # masked/pruned pools never leave the pool
        if r.batch == 1:
            assert r.distinct == pytest.approx(p.top_k)               # one token reads exactly k (or k') experts
        assert r.expert_bytes == pytest.approx(r.distinct * 2 * per_expert)  # 2 MoE layers
        assert r.total_bytes > r.expert_bytes
        assert r.distinct <= expected_distinct(p.experts, p.top_k, r.batch) * 2
    rep = Report("t", tmp_path)
    _tables(rep, "tiny", measured, hf, read_bw=1e10)
    _plots(rep, "tiny", measured, 1e10, 1e10)
    goals = _goals("tiny", measured, hf, 1e10)
    assert any("engine" in g[0] for g in goals) and any("50% pool" in g[0] for g in goals)
    _report_model(rep, "tiny", measured, slo=None)
    rep.write()
    text = (tmp_path / "report.md").read_text()
    assert "mask 50%" in text and "formula" in text and "tok/s at SLO" in text
    assert (tmp_path / "tiny_bandwidth.png").exists() and (tmp_path / "tiny_slo.png").exists()


def test_throughput_at_slo_interpolates():
    pts = [(100.0, 100.0), (50.0, 400.0), (20.0, 640.0)]              # (per-user, machine) as batch grows
    assert throughput_at_slo(pts, 100.0) == (100.0, 100.0)
    u, t = throughput_at_slo(pts, 75.0)
    assert u == 75.0 and t == pytest.approx(250.0)
    assert throughput_at_slo(pts, 10.0) == (20.0, 640.0)
    assert throughput_at_slo(pts, 200.0) is None
    # a noisy curve: per-user speed rises again at a larger batch that still meets the SLO
    noisy = [(133.7, 134.0), (95.4, 191.0), (87.1, 349.0), (88.3, 707.0), (75.0, 1200.0)]
    u, t = throughput_at_slo(noisy, 85.7)
    assert u == 85.7 and t == pytest.approx(707.0 + (1200.0 - 707.0) * (88.3 - 85.7) / (88.3 - 75.0))


def test_bench_models_load_in_the_dtype_asked(tmp_path):
    """`bench decode --dtype bfloat16` measures the weights as real checkpoints ship them."""
    from moetailor.bench.decode import load_bench_model

    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(tmp_path)
    assert {p.dtype for p in load_bench_model(str(tmp_path), dtype="bfloat16").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_bench_model(str(tmp_path)).parameters()} == {torch.float32}


def test_bandwidth_share_never_prints_above_100_percent():
    from moetailor.bench.decode import bandwidth_share

    assert bandwidth_share(5e9, 10e9) == "50%"
    assert bandwidth_share(10.4e9, 10e9) == ">100% (cache-resident or noise)"


def test_few_or_unsteady_steps_are_flagged_noisy():
    from moetailor.bench.decode import DecodeConfig, flagged
    from moetailor.bench.measure import DecodeResult, relative_spread, step_is_noisy

    assert step_is_noisy(4, 0.0) and step_is_noisy(16, 0.5) and not step_is_noisy(16, 0.1)
    assert relative_spread([1.0, 1.0, 1.0]) == 0.0 and relative_spread([1.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == (4.0 - 2.0) / 3.0
    steady = DecodeResult(1, 1e-3, 1, 1, 1, 16, [], 0.05)
    short = DecodeResult(1, 1e-3, 1, 1, 1, 4, [], 0.0)
    assert flagged("0.62x", steady) == "0.62x" and flagged("0.62x", steady, short) == "0.62x (noisy)"
    assert DecodeConfig(quick=True).resolved().steps >= 8            # --quick times enough steps for a median


def test_the_transformers_goal_is_scored_at_the_batch_it_names():
    from moetailor.bench.decode import hf_goal
    from moetailor.bench.measure import DecodeResult
    from moetailor.bench.pools import Pool

    def cells(b):
        return {"full": Measured("m", Pool("full", "full", 1.0, 8, 2), DecodeResult(b, 0.01, 1, 1, 1, 16, [], 0.0))}

    from moetailor.bench.decode import Measured
    assert hf_goal("m", {64: 0.05}, {64: cells(64)}) == ("engine >= 1.5x transformers at batch 32", "m",
                                                          "batch 32 not measured", "n/a")
    assert hf_goal("m", {32: 0.02}, {32: cells(32)})[2:] == ("B=32: 2.00x", "yes")
