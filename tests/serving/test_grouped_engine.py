"""The engine on a grouped (DeepSeek-V3 style) model: greedy equals transformers, phase-aware decode
with a group-balanced plan equals a cache hand-over reference, per-request budgets equal plan top-k,
and the collapse guard catches a group-balanced pool that never emits EOS."""
from __future__ import annotations

import pytest
from engine_helpers import hf_greedy, random_prompts, stock_handover, stock_pruned_twin, stock_twin
from test_guard import length_hits, with_and_without_guard

from moetailor.models.tiny import tiny_grouped_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams

BALANCED = (0, 1, 4, 5, 8, 9, 12, 13)      # 2 of 4 in every group: a prunable decode pool
DROPPED = (2, 3, 6, 7, 10, 11, 14, 15)


@pytest.fixture
def model():
    """A fresh model per test: an engine installs its kernels on the model it is given."""
    return tiny_grouped_model(seed=4)


def test_greedy_matches_transformers(model):
    reference = stock_twin(model)
    prompts = random_prompts([3, 11, 7, 1, 19], seed=4)
    llm = LLM(model, block_size=4, num_kv_blocks=128)
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))):
        assert out.token_ids == hf_greedy(reference, prompt, 8), f"prompt of {len(prompt)} tokens"
    assert llm.block_manager.num_free == 128


def test_phase_aware_decode_with_a_balanced_pool(model):
    plan = uniform_plan(model, decode=LayerPolicy(keep=BALANCED))
    full_ref, pruned_ref = stock_twin(model), stock_pruned_twin(model, plan)
    prompts = random_prompts([4, 13, 8], seed=5)
    llm = LLM(model, plan, block_size=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    full = LLM(model, block_size=4).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == stock_handover(full_ref, pruned_ref, prompt, 10)
    assert [o.token_ids for o in outs] != [o.token_ids for o in full], "the balanced pool should change some output"
    decode = [r for r in llm.step_log if r.phase == "decode"]
    assert decode and all(max(r.distinct_experts.values()) <= len(BALANCED) for r in decode)


def test_per_request_expert_top_k_equals_plan_top_k(model):
    prompts = random_prompts([6, 10], seed=6)
    plan = uniform_plan(model, decode=LayerPolicy(top_k=2), prefill=LayerPolicy(top_k=2))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    by_plan = LLM(model, plan).generate(prompts, params)
    by_request = LLM(model).generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True, expert_top_k=2)] * 2)
    full = LLM(model).generate(prompts, params)
    assert [o.token_ids for o in by_plan] == [o.token_ids for o in by_request] != [o.token_ids for o in full]
    mixed = LLM(model).generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True, expert_top_k=2), params])
    assert mixed[0].token_ids == by_plan[0].token_ids and mixed[1].token_ids == full[1].token_ids


def test_guard_catches_a_collapsing_balanced_pool(model):
    prompts = random_prompts([5 + i % 7 for i in range(32)], seed=7)
    params = SamplingParams(max_tokens=48)
    plan = uniform_plan(model, decode=LayerPolicy(keep=BALANCED))
    off, llm, on, full = with_and_without_guard(model, plan, prompts, params, DROPPED)
    hits_off, hits_on = length_hits(off), length_hits(on)
    assert length_hits(full) <= 2
    assert hits_off >= 8, hits_off  # the reduced pool collapses without the guard
    snap = llm.guard.snapshot()["policies"]["default"]
    assert snap["state"] == "tripped" and hits_on <= hits_off // 2, (snap, hits_on, hits_off)
