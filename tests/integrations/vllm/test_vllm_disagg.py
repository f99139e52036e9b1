"""Disaggregated phase-aware serving on vLLM: prefill on the full model, decode on the pruned
checkpoint, KV through moetailor's connector; outputs equal moetailor's phase-aware engine."""
from __future__ import annotations

import contextlib

import pytest

from vllm_helpers import BUNDLED_PLAN, MAX_TOKENS, SKIP_REASON, engine_token_ids, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    from moetailor.transforms import prune_checkpoint

    return prune_checkpoint("reference", BUNDLED_PLAN, tmp_path_factory.mktemp("vllm") / "pruned")


@pytest.fixture(scope="module")
def pair(pruned, tmp_path_factory):
    from moetailor.integrations.vllm.disagg import pair_kwargs

    storage = tmp_path_factory.mktemp("kv")
    prefill, decode = pair_kwargs("reference", pruned, storage, kv_cache_mib=128, max_num_seqs=8)
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(vllm_engine(**prefill)), stack.enter_context(vllm_engine(**decode)), storage


def test_disaggregated_pair_equals_phase_aware_engine(pair, prompts):
    from vllm import SamplingParams

    from moetailor.engine import LLM
    from moetailor.integrations.vllm.disagg import generate_pair
    from moetailor.plans import Plan

    prefill_llm, decode_llm, storage = pair
    tok = LLM("reference").tokenizer
    ids = [tok.encode(p) for p in prompts]
    plan = Plan.load(BUNDLED_PLAN)
    expected = engine_token_ids(plan.phase_aware(), ids)
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


def test_a_preempted_request_reloads_its_prompt_kv_through_the_connector(quarter_plan, prompts, tmp_path):
    """The decode instance's cache holds 5 blocks of 32 tokens for 12 requests of up to 93 tokens, so
    vLLM preempts (recompute) and resumes: each resumed request must load its prompt's full-model KV
    from the connector again, or its prompt is recomputed on the pruned model and the rest of its
    output changes. The decode model keeps a quarter of the experts, so that change shows."""
    from vllm import SamplingParams

    from moetailor.engine import LLM
    from moetailor.integrations.vllm.disagg import generate_pair, pair_kwargs
    from moetailor.plans import Plan
    from moetailor.transforms import prune_checkpoint

    pruned = prune_checkpoint("reference", quarter_plan, tmp_path / "pruned-25")
    ids = [LLM("reference").tokenizer.encode(p) for p in prompts]
    expected = engine_token_ids(Plan.load(quarter_plan).phase_aware(), ids)
    common = dict(kv_cache_mib=None, max_num_seqs=8, block_size=32, max_model_len=128)
    prefill, decode = pair_kwargs("reference", pruned, tmp_path / "kv", **common)
    with vllm_engine(**prefill, kv_cache_memory_bytes=64 << 20) as prefill_llm, \
            vllm_engine(**decode, kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=5,
                        disable_log_stats=False) as decode_llm:
        got = generate_pair(prefill_llm, decode_llm, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        preempted = sum(m.value for m in decode_llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preempted > 0, "the decode instance never preempted: the test did not test resumption"
    assert got == expected, f"{sum(g != e for g, e in zip(got, expected))} of {len(got)} outputs differ " \
                            f"after {preempted:.0f} preemptions"
