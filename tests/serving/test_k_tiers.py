"""The k-aware batching policy: never fewer experts than asked, every request served exactly once
(offline) and within a bounded wait (online), tier decisions follow the cost model, bad budgets
get clear errors."""
import math
import random

import pytest

from moetailor.routing.budgets import expert_top_k_value, validate_expert_top_k
from moetailor.routing.k_tiers import (
    KRequest,
    OnlineLanes,
    StepCost,
    plan_offline,
)
from moetailor.routing.traffic import expected_distinct

# a memory-bound-ish model: touching an expert dominates, compute per route is small
COST = StepCost(num_layers=6, num_experts=256, per_expert=1e-4, per_route=2e-6, per_token=1e-4, fixed=1e-3)


def mix(n, ks, seed=0):
    rng = random.Random(seed)
    return [KRequest(f"r{i}", rng.choice(ks), arrival=i * 0.01) for i in range(n)]


def fcfs_max_k_seconds(requests, max_batch, cost):
    """The baseline: batches in arrival order, each run at its largest member's k (one step each)."""
    reqs = sorted(requests, key=lambda r: (r.arrival, r.request_id))
    chunks = [reqs[i:i + max_batch] for i in range(0, len(reqs), max_batch)]
    return sum(cost.seconds(max(r.k for r in c), len(c)) for c in chunks)


def check_budgets(requests, batches):
    k_of = {r.request_id: r.k for r in requests}
    for b in batches:
        assert all(b.k >= k_of[i] for i in b.request_ids), b
        assert set(b.upgraded) == {i for i in b.request_ids if k_of[i] < b.k}


def test_expected_distinct():
    assert expected_distinct(64, 8, 1) == pytest.approx(8)
    assert expected_distinct(64, 64, 3) == pytest.approx(64)
    assert expected_distinct(64, 8, 0) == 0
    assert expected_distinct(256, 4, 16) < expected_distinct(256, 32, 16)


@pytest.mark.parametrize("seed", range(5))
def test_offline_never_below_budget_and_serves_everyone_once(seed):
    reqs = mix(53, [2, 4, 8, 16, 32], seed)
    batches = plan_offline(reqs, max_batch=8, cost=COST)
    check_budgets(reqs, batches)
    ids = [i for b in batches for i in b.request_ids]
    assert sorted(ids) == sorted(r.request_id for r in reqs)
    assert all(len(b.request_ids) <= 8 for b in batches)
    # a k-aware plan is never estimated slower than the max-k baseline on a heterogeneous mix
    assert sum(COST.seconds(b.k, len(b.request_ids)) for b in batches) <= fcfs_max_k_seconds(reqs, 8, COST)


def test_offline_flush_or_merge_follows_the_cost_model():
    reqs = [KRequest(f"a{i}", 4) for i in range(9)] + [KRequest(f"b{i}", 32) for i in range(7)]
    # a per-step cost dominates (launch, attention) and the big tier has room: the residual joins it
    merge = plan_offline(reqs, 8, StepCost(6, 256, per_expert=1e-4, fixed=1.0))
    assert [b.k for b in merge] == [4, 32] and merge[1].upgraded == ("a8",)
    # compute per route dominates: running the residual at k=32 costs more than its own small step
    flush = plan_offline(reqs, 8, StepCost(6, 256, per_expert=0.0, per_route=1e-3))
    assert sorted(b.k for b in flush) == [4, 4, 32] and all(not b.upgraded for b in flush)
    check_budgets(reqs, merge), check_budgets(reqs, flush)


def test_offline_orders_batches_by_oldest_member():
    reqs = [KRequest("old-high", 32, 0.0)] + [KRequest(f"n{i}", 2, 1.0 + i) for i in range(16)]
    batches = plan_offline(reqs, 8, COST)
    assert "old-high" in batches[0].request_ids


def test_online_lanes_bounded_wait_and_budgets():
    """A steady stream of cheap low-k requests must not starve the lone high-k request."""
    lanes = OnlineLanes(COST, max_batch=4, max_wait=2, adapt_every=4)
    running = [KRequest("high", 32, 0.0)] + [KRequest(f"low{i}", 2, 0.1 * i) for i in range(12)]
    lanes.boundary = 2
    last = {r.request_id: -1 for r in running}
    worst = {r.request_id: 0 for r in running}
    for step in range(60):
        # arrivals: a new low-k request every step, an old one finishes
        running.append(KRequest(f"new{step}", 2, 10 + step))
        done = running.pop(1)
        lanes.forget(done.request_id)
        last.setdefault(running[-1].request_id, step)
        worst.setdefault(running[-1].request_id, 0)
        batch = lanes.next_batch(running)
        check_budgets(running, [batch])
        assert len(batch.request_ids) <= 4
        for i in batch.request_ids:
            worst[i] = max(worst[i], step - last[i])
            last[i] = step
    assert worst["high"] <= lanes.max_wait + 1
    low_lane = sum(1 for r in running if r.k <= (lanes.boundary or 0))
    lane_size = max(low_lane, len(running))    # a lane of n waits at most ceil(n / max_batch) turns
    assert max(worst[r.request_id] for r in running) <= math.ceil(lane_size / lanes.max_batch) * (lanes.max_wait + 1)


def test_online_boundary_adapts_and_collapses():
    # compute-bound: separating k=2 from k=32 pays, so two lanes
    lanes = OnlineLanes(StepCost(6, 256, per_expert=0.0, per_route=1e-3, fixed=1e-4), max_batch=16)
    running = [KRequest(f"l{i}", 2) for i in range(8)] + [KRequest(f"h{i}", 32) for i in range(8)]
    lanes.next_batch(running)
    assert lanes.boundary == 2
    # a big fixed per-step cost: one lane is cheaper, the boundary collapses
    one = OnlineLanes(StepCost(6, 256, per_expert=1e-6, fixed=1.0), max_batch=16, boundary=2)
    one.next_batch(running)
    assert one.boundary is None


def test_validate_expert_top_k():
    assert validate_expert_top_k(None, 32) == 32
    assert validate_expert_top_k(12, 32, parts=4) == 12
    with pytest.raises(ValueError, match=r"1\.\.32 .*4 sub-experts x 8 experts"):
        validate_expert_top_k(33, 32, parts=4)
    with pytest.raises(ValueError, match="out of range"):
        validate_expert_top_k(0, 32)
    with pytest.raises(ValueError, match="integer"):
        validate_expert_top_k(2.5, 32)
    with pytest.raises(ValueError, match="integer"):
        validate_expert_top_k(True, 32)
    with pytest.raises(ValueError, match="no experts"):
        validate_expert_top_k(2, None)


def test_expert_top_k_as_a_json_client_sends_it():
    """The server's parser and the vLLM plugin read JSON: 4.0 is 4; the model's range is checked later."""
    assert expert_top_k_value(None) is None
    assert expert_top_k_value(4.0) == 4 and type(expert_top_k_value(4.0)) is int
    assert expert_top_k_value(999) == 999
    for bad, needle in ((0, "out of range"), (-3, "out of range"), (2.5, "integer"), ("four", "integer"),
                        (False, "integer"), ([1], "integer"), ("x" * 10_000, "integer")):
        with pytest.raises(ValueError, match=needle) as e:
            expert_top_k_value(bad)
        assert str(e.value).startswith("expert_top_k") and len(str(e.value)) < 200


def test_cost_fit_recovers_coefficients():
    truth = StepCost(6, 256, per_expert=2e-4, per_route=3e-6, per_token=5e-4, fixed=2e-3)
    samples = []
    for b in (1, 2, 4, 8, 16):
        for k in (4, 16, 32):
            u = expected_distinct(256, k, b)
            samples.append((b, k, u, truth.seconds(k, b)))
    fit = StepCost.fit(samples, 6, 256)
    for name in ("per_expert", "per_route", "per_token", "fixed"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-3)
    with pytest.raises(ValueError, match="at least 4"):
        StepCost.fit(samples[:2], 6, 256)


def test_engine_rejects_out_of_range_expert_top_k():
    import pytest

    from moetailor.models.tiny import tiny_model
    from moetailor.serving import LLM, SamplingParams

    llm = LLM(tiny_model("qwen2_moe", top_k=2), num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"expert_top_k=3 is out of range.*\[1, 2\]"):
        llm.add_request([5, 6, 7], SamplingParams(max_tokens=2, expert_top_k=3))
    for bad in (0, 1.0, "2"):   # the Python API takes integers only; every budget is checked at admission
        with pytest.raises(ValueError, match="expert_top_k"):
            llm.add_request([5, 6, 7], SamplingParams(max_tokens=2, expert_top_k=bad))
    assert not llm.has_unfinished()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, expert_top_k=1))
    assert len(out[0].token_ids) == 2


# ---- the engine's k-aware schedules -------------------------------------------------------------

def _budget_workload():
    from engine_helpers import random_prompts

    from moetailor.serving import SamplingParams

    prompts = random_prompts([5, 9, 4, 7, 6, 8, 3, 10, 5, 6], seed=11)
    ks = [1, 4, 1, 4, 1, 4, 1, 4, 1, 4]
    return prompts, [SamplingParams(max_tokens=6, ignore_eos=True, expert_top_k=k) for k in ks]


@pytest.fixture(scope="module")
def budget_model():
    from moetailor.models.tiny import tiny_model
    return tiny_model("qwen2_moe", seed=3, num_experts=16, top_k=4)


SPLIT_LANES = StepCost(2, 16, per_expert=1e-3)               # touching experts dominates: keep budgets apart
ONE_LANE = StepCost(2, 16, per_expert=1e-6, fixed=1.0)       # a step's fixed cost dominates: one lane


@pytest.mark.parametrize("schedule,cost", [("lanes", SPLIT_LANES), ("tiers", SPLIT_LANES), ("max", None)])
def test_engine_schedules_keep_every_budget_and_serve_everyone(budget_model, schedule, cost):
    from moetailor.serving import LLM

    prompts, params = _budget_workload()
    ref = LLM(budget_model, max_num_seqs=4, num_kv_blocks=64).generate(prompts, params)
    llm = LLM(budget_model, max_num_seqs=4, num_kv_blocks=64, k_schedule=schedule, k_cost=cost)
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    decode_ks = {r.mean_k for r in llm.step_log if r.phase == "decode"}
    if schedule == "max":        # every token at its step's largest budget: outputs may differ, budgets only grow
        assert decode_ks <= {1.0, 4.0}
        assert max(r.mean_k for r in llm.step_log if r.phase == "decode") == 4.0
    else:                        # budgets kept apart: no decode step mixes k=1 and k=4 requests
        assert decode_ks == {1.0, 4.0}
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_engine_lanes_collapse_to_one_when_steps_cost_the_same(budget_model):
    from moetailor.serving import LLM

    prompts, params = _budget_workload()
    llm = LLM(budget_model, max_num_seqs=10, num_kv_blocks=64, k_schedule="lanes", k_cost=ONE_LANE)
    llm.generate(prompts, params)
    assert any(1.0 < r.mean_k < 4.0 for r in llm.step_log if r.phase == "decode")   # budgets share steps


def test_engine_fits_its_step_cost_and_rejects_unknown_schedules(budget_model):
    from moetailor.serving import LLM

    prompts, params = _budget_workload()
    llm = LLM(budget_model, max_num_seqs=4, num_kv_blocks=64, k_schedule="lanes")
    with pytest.raises(ValueError, match="needs 8 measured decode steps"):
        llm.fit_k_cost()
    llm.generate(prompts, params)
    cost = llm.fit_k_cost()
    assert llm.budgets.lanes.cost is cost and cost.num_experts == 16
    with pytest.raises(ValueError, match="unknown k_schedule 'fastest'; choose from: mixed"):
        LLM(budget_model, k_schedule="fastest")


@pytest.mark.parametrize("lanes_s, joint_s, settles", [(0.004, 0.010, "lanes"), (0.009, 0.010, "joint")])
def test_measured_choice_keeps_the_mode_the_clock_says_is_faster(lanes_s, joint_s, settles):
    """8 requests: a lanes step decodes 4 tokens in ``lanes_s``, a joint step 8 in ``joint_s``; each mode
    gets a trial, the faster runs, and after ``recheck`` steps the other is tried again."""
    from moetailor.routing.k_tiers import MeasuredChoice

    choice = MeasuredChoice(window=4, recheck=20)
    modes = []
    for _ in range(60):
        modes.append(choice.mode)
        choice.record(*((4, lanes_s) if choice.mode == "lanes" else (8, joint_s)))
    assert modes[:8] == ["lanes"] * 4 + ["joint"] * 4                  # the cost model's proposal, then a trial
    loser = "joint" if settles == "lanes" else "lanes"
    assert modes[8:].count(settles) > 3 * modes[8:].count(loser) > 0   # mostly the faster, with re-trials
    assert loser in modes[30:]                                          # a re-trial after `recheck` steps
    choice.record(0, 1.0)
    choice.record(3, 0.0)                                               # nothing decoded / no time: ignored
    assert all(t > 0 and s > 0 for mode in choice.samples.values() for t, s in mode)
