"""Disaggregated phase-aware serving on vLLM: prefill on the full model, decode on the pruned
checkpoint, KV through moetailor's connector; outputs equal moetailor's phase-aware engine."""
from __future__ import annotations

import contextlib

import pytest
from vllm_helpers import MAX_TOKENS, SKIP_REASON, engine_token_ids, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, quarter_plan):
    from moetailor.transforms import prune_checkpoint

    return prune_checkpoint("reference", quarter_plan, tmp_path_factory.mktemp("vllm") / "pruned")


@pytest.fixture(scope="module")
def pair(pruned, tmp_path_factory):
    from moetailor.integrations.vllm.disagg import pair_kwargs

    storage = tmp_path_factory.mktemp("kv")
    prefill, decode = pair_kwargs("reference", pruned, storage, kv_cache_mib=128, max_num_seqs=8)
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(vllm_engine(**prefill)), stack.enter_context(vllm_engine(**decode)), storage


def test_disaggregated_pair_equals_phase_aware_engine(pair, prompts, quarter_plan):
    from vllm import SamplingParams

    from moetailor.integrations.vllm.disagg import generate_pair
    from moetailor.plans import Plan
    from moetailor.serving import LLM

    prefill_llm, decode_llm, storage = pair
    tok = LLM("reference").tokenizer
    ids = [tok.encode(p) for p in prompts]
    plan = Plan.load(quarter_plan)
    expected = engine_token_ids(plan.phase_aware(), ids)
    assert expected != engine_token_ids(None, ids), "the plan must change outputs to be tested"
    got = generate_pair(prefill_llm, decode_llm, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert got == expected
    # the decode instance alone (its own prefill on the pruned model) gives other outputs: the
    # transferred KV is what makes the pair phase-aware
    assert vllm_token_ids(decode_llm, [{"prompt_token_ids": i} for i in ids]) != expected
    assert not any(storage.iterdir()), "the decode instance frees each prompt's stored KV when the request ends"


def test_prefill_instance_alone_equals_full_engine(pair, prompts):
    prefill_llm = pair[0]
    assert vllm_token_ids(prefill_llm, prompts) == engine_token_ids(None, prompts)


def test_pair_refuses_a_decode_model_pruned_from_another_model(tmp_path):
    from moetailor.integrations.vllm.disagg import check_pair

    with pytest.raises(FileNotFoundError, match="not a `moetailor prune` checkpoint"):
        check_pair("reference", tmp_path)

