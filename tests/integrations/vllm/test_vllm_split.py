"""MoE-Prism in vLLM: a `moetailor split` checkpoint (a stock MoE with N*m experts, top-N*k) served
by stock vLLM equals moetailor's engine at the full budget and at per-request budgets (eager mode),
and the k-aware scheduler (scheduler_cls) changes which requests share a step, not what they output."""
from __future__ import annotations

import json

import pytest
from vllm_helpers import SKIP_REASON, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)

BUDGETS = [4, 16]          # sub-experts per token of the 2-part split (full budget 2 x 8 = 16)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    from moetailor.transforms.split import split_checkpoint

    path, _ = split_checkpoint("reference", "tasks", 2, tmp_path_factory.mktemp("vllm") / "split", method="random",
                               gate="proxy", tokens=2048, seq_len=128, progress=False)
    return path


@pytest.fixture(scope="module")
def budgets(prompts):
    return [BUDGETS[i % 2] for i in range(len(prompts))]


def engine_ids(model, prompts, ks=None, max_tokens=40):
    from moetailor.serving import LLM, SamplingParams

    llm = LLM(str(model))
    ks = ks or [None] * len(prompts)
    return [list(o.token_ids) for o in llm.generate(prompts, [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             expert_top_k=k) for k in ks])]


@pytest.fixture(scope="module")
def stock(split):
    from moetailor.integrations.vllm.launch import engine_kwargs

    with vllm_engine(**engine_kwargs(split, kv_cache_mib=128, max_num_seqs=8)) as llm:
        yield llm


def test_split_checkpoint_is_served_by_stock_vllm_at_full_budget(stock, split, prompts):
    cfg = stock.llm_engine.model_config.hf_config
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (128, 16)
    assert vllm_token_ids(stock, prompts) == engine_ids(split, prompts)


def test_split_checkpoint_budgets_equal_engine(stock, split, prompts, budgets):
    got = vllm_token_ids(stock, prompts, [{"expert_top_k": k} for k in budgets])
    assert got == engine_ids(split, prompts, budgets)
    assert got != vllm_token_ids(stock, prompts), "the budgets must change outputs for this test to mean anything"


@pytest.fixture(scope="module")
def k_aware(split, tmp_path_factory):
    from moetailor.integrations.vllm.launch import engine_kwargs
    from moetailor.integrations.vllm.scheduler import scheduler_kwargs

    log = tmp_path_factory.mktemp("sched") / "steps.jsonl"
    # 4 running requests at most: admission order (tiers) and lanes both have a choice to make; the
    # lanes are kept whatever they cost (measure=False), so that every step shows them
    with vllm_engine(**engine_kwargs(split, kv_cache_mib=128, max_num_seqs=4,
                                     **scheduler_kwargs("tiers+lanes", log=log, measure=False))) as llm:
        yield llm, log


def test_k_aware_scheduler_groups_requests_by_budget(k_aware, stock, prompts, budgets):
    llm, log = k_aware
    assert llm.llm_engine.vllm_config.scheduler_config.get_scheduler_cls().__name__ == "KAwareScheduler"
    extra = [{"expert_top_k": k} for k in budgets]
    got = vllm_token_ids(llm, prompts, extra)
    assert got == vllm_token_ids(stock, prompts, extra)          # who runs together, not what comes out
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    # tiers: the waiting queue is grouped by budget (requests arrive 4, 16, 4, 16, ...; FIFO keeps that)
    def changes(ks):
        return sum(a != b for a, b in zip(ks, ks[1:]))
    assert any(len(s["waiting"]) >= 4 and changes(s["waiting"]) < len(s["waiting"]) - 1 for s in steps)
    # lanes: some steps leave running decode requests of the other lane out, never mixing the lanes
    assert any(s["held"] for s in steps)
    for s in steps:
        decode_ks = {k for _, k, phase, _ in s["scheduled"] if phase == "decode"}
        if s["boundary"] is not None and decode_ks:
            assert max(decode_ks) <= s["boundary"] or min(decode_ks) > s["boundary"]
    assert sum(1 for s in steps for _, _, phase, _ in s["scheduled"] if phase == "decode") == \
        sum(len(g) - 1 for g in got)                                # every decode token ran exactly once


def test_measured_lanes_time_decode_steps_and_keep_outputs(split, stock, prompts, budgets, tmp_path):
    """The default scheduler (the clock decides lanes or one joint step): steps are timed through
    ``update_from_output`` without changing what comes out, and the step log says which mode ran."""
    from moetailor.integrations.vllm.launch import engine_kwargs
    from moetailor.integrations.vllm.scheduler import scheduler_kwargs

    log = tmp_path / "steps.jsonl"
    extra = [{"expert_top_k": k} for k in budgets]
    with vllm_engine(**engine_kwargs(split, kv_cache_mib=128, max_num_seqs=4,
                                     **scheduler_kwargs("lanes", log=log))) as llm:
        got = vllm_token_ids(llm, prompts, extra)
    assert got == vllm_token_ids(stock, prompts, extra)
    modes = [json.loads(line)["mode"] for line in log.read_text().splitlines()]
    assert set(modes) <= {"lanes", "joint"} and modes[0] == "lanes"
    assert "joint" in modes, "after a trial of 8 timed all-decode steps the joint step must get its trial"


def test_scheduler_kwargs_refuse_an_unknown_schedule():
    from moetailor.integrations.vllm.scheduler import scheduler_kwargs

    with pytest.raises(ValueError, match="unknown k schedule 'fast'"):
        scheduler_kwargs("fast")
