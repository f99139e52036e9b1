"""The GPU roofline projection: byte accounting, SLO batch search, pool speedups."""
import pytest

from moetailor.bench.roofline import (
    GPUS,
    IDEAL,
    REALISTIC,
    SHAPES,
    Efficiency,
    kept_experts,
    memory_batch_cap,
    project,
    resident_bytes,
    roofline_costs,
    slo_batch,
    step_cost,
)
from moetailor.routing.traffic import expected_distinct


def test_qwen36_expert_pool_is_60_gib():
    s = SHAPES["qwen3.6-35b-a3b"]
    assert s.moe_layers * s.experts * s.expert_params * 2 == 40 * 256 * 3 * 2048 * 512 * 2
    assert s.moe_layers * s.experts * s.expert_params * 2 / 2**30 == pytest.approx(60.0)
    assert 2.5e9 < s.active_params() < 3.5e9                         # "A3B"


def test_step_bytes_add_up():
    s, g = SHAPES["olmoe-1b-7b"], GPUS["h100"]
    c = step_cost(s, g, batch=8, context=1000, keep=1.0)
    assert c.expert_bytes == pytest.approx(16 * expected_distinct(64, 8, 8) * 3 * 2048 * 1024 * 2)
    assert c.kv_bytes == 8 * 1000 * 16 * 2 * 16 * 128 * 2
    assert c.dense_bytes == s.dense_params * 2
    assert c.seconds == pytest.approx(max(c.bytes / g.bandwidth, c.flops / g.flops))
    assert c.bound == "memory"
    two = step_cost(s, g, batch=8, context=1000, num_gpus=2)
    assert two.seconds == pytest.approx(c.seconds / 2)


def test_the_roofline_is_the_engines_step_cost_model():
    """One cost model: the roofline's memory and compute times are ``StepCost``s (the class the engine's
    schedules plan with), and a step without overlap costs their sum plus the fixed overheads."""
    from moetailor.routing.traffic import StepCost

    s, g = SHAPES["qwen3.6-35b-a3b"], GPUS["a100"]
    for batch, keep in ((1, 1.0), (8, 0.5), (64, 0.25)):
        memory, compute = roofline_costs(s, g, 5120, keep, 2, REALISTIC)
        assert type(memory) is StepCost and type(compute) is StepCost
        c = step_cost(s, g, batch, 5120, keep, 2, REALISTIC)
        expected = memory.seconds(s.top_k, batch) + compute.seconds(s.top_k, batch) + REALISTIC.overhead_s
        assert c.seconds == pytest.approx(expected)
        ideal_memory, _ = roofline_costs(s, g, 5120, keep, 2)
        assert ideal_memory.seconds(s.top_k, batch) == pytest.approx(c.bytes / (2 * g.bandwidth))


def test_smaller_pool_reads_less_and_keeps_at_least_k():
    s, g = SHAPES["qwen3-30b-a3b"], GPUS["a100"]
    full, half = (step_cost(s, g, 64, 2048, keep) for keep in (1.0, 0.5))
    assert half.expert_bytes < full.expert_bytes and half.seconds < full.seconds
    assert kept_experts(SHAPES["mixtral-8x7b"], 0.1) == 2                # never below top-k


def test_slo_batch_is_largest_that_fits():
    s, g = SHAPES["qwen3.6-35b-a3b"], GPUS["a100"]
    at = slo_batch(s, g, 50, 5120, 1.0, cap=10_000, num_gpus=2)
    assert at is not None and at.seconds <= 1 / 50
    assert step_cost(s, g, at.batch + 1, 5120, 1.0, 2).seconds > 1 / 50
    capped = slo_batch(s, g, 50, 5120, 1.0, cap=10, num_gpus=2)
    assert capped.batch == 10
    assert slo_batch(s, g, 1e6, 5120, 1.0, cap=100) is None           # unreachable SLO


def test_projection_pruned_pools_beat_full_and_disaggregated_frees_memory():
    s, g = SHAPES["qwen3.6-35b-a3b"], GPUS["a100"]
    proj = project(s, g, [0.5, 0.25], 50, 5120, 9216, num_gpus=2)
    full = proj[0]
    assert full.mode == "full" and full.speedup == 1.0
    by = {(p.keep, p.mode): p for p in proj[1:]}
    assert by[(0.5, "disaggregated")].cap > by[(0.5, "colocated")].cap == full.cap
    assert 1.0 < by[(0.5, "disaggregated")].speedup <= by[(0.25, "disaggregated")].speedup
    assert by[(0.5, "disaggregated")].slimwise == 1.81 and by[(0.25, "disaggregated")].slimwise == 2.39
    assert resident_bytes(s, 0.5) < resident_bytes(s, 1.0)
    assert memory_batch_cap(s, g, 9216, resident_bytes(s, 1.0), 1) < memory_batch_cap(s, g, 9216, resident_bytes(s, 1.0), 2)


def test_per_sequence_cost_lowers_the_gain():
    s, g = SHAPES["qwen3.6-35b-a3b"], GPUS["a100"]
    ideal = project(s, g, [0.5], 50, 5120, 9216, 2, IDEAL)[1].speedup
    costly = project(s, g, [0.5], 50, 5120, 9216, 2, Efficiency(per_seq_s=80e-6))[1].speedup
    assert costly < ideal


def test_cli_project_writes_report(tmp_path):
    from moetailor.cli.main import main

    assert main(["bench", "project", "--gpu", "h200", "--model-shape", "olmoe-1b-7b", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "SlimWise" in text and "speedup" in text
    assert (tmp_path / "slo_projection.png").stat().st_size > 1000
    assert main(["bench", "project", "--keep", "1.5", "--out", str(tmp_path)]) == 2
