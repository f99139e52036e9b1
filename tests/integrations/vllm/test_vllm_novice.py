"""Novice plans (MoNE) inside vLLM, in its default compiled mode: a route to a replaced expert adds
g * c_e to its MoE layer's output (``routing.step_constants``) and reads no weight of that expert.
The plan's two phases replace different experts (a 32/64 novice prefill, a 16/64 novice decode) and
small steps mix prefill chunks with decode tokens, so each token must get its own phase's constants.
Greedy outputs and their logprobs equal moetailor's engine; the plan changes them from the full
model's, and switching the running engine to the full router gives the full model's outputs."""
from __future__ import annotations

import dataclasses

import pytest

from vllm_helpers import SKIP_REASON, vllm_engine

pytest.importorskip("vllm", reason=SKIP_REASON)

from moetailor.integrations.vllm.rpc import call, route_totals, use_plan  # noqa: E402

MAX_TOKENS = 24
DECODE_POOL = 16


@pytest.fixture(scope="module")
def novice_plan(tmp_path_factory):
    from moetailor.calibration import calibrate
    from moetailor.models import load_model, load_tokenizer
    from moetailor.plans.criteria import make_plan

    out = tmp_path_factory.mktemp("novice")
    model = load_model("reference")
    stats = calibrate(model, load_tokenizer("reference"), "tasks", 1024, batch_tokens=512, seq_len=128, progress=False)
    stats_path = str(stats.save(out / "stats.safetensors"))
    prefill = make_plan(stats, model, "mone", keep_experts=32, novice=True, stats_path=stats_path)
    decode = make_plan(stats, model, "mone", keep_experts=DECODE_POOL, novice=True, stats_path=stats_path)
    plan = dataclasses.replace(decode, prefill=prefill.decode)
    return plan.save(out / "novice.json")


@pytest.fixture(scope="module")
def novice_vllm(novice_plan):
    from moetailor.integrations.vllm.launch import engine_kwargs

    # 64 tokens per step: prompts are prefilled in chunks that share steps with other requests' decode tokens
    kwargs = engine_kwargs("reference", plan=novice_plan, kv_cache_mib=128, max_num_batched_tokens=64,
                           max_num_seqs=8, enforce_eager=False)
    assert kwargs["enable_prefix_caching"] is False           # the phases differ
    kwargs["additional_config"]["moetailor_record_routes"] = True
    with vllm_engine(**kwargs) as llm:
        yield llm


def engine_run(plan_path, prompts):
    """moetailor's engine, fp32 greedy: token ids and each one's logprob."""
    from moetailor.serving import LLM, SamplingParams
    from moetailor.plans import Plan

    llm = LLM("reference", Plan.load(plan_path) if plan_path else None)
    out = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0))
    return [list(o.token_ids) for o in out], [[lp.logprob for lp in o.logprobs] for o in out]


def vllm_run(llm, prompts):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0), use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return ids, logprobs


def test_novice_plan_equals_engine_and_reads_no_replaced_expert(novice_vllm, novice_plan, prompts):
    call(novice_vllm, route_totals, reset=True)
    got, got_lp = vllm_run(novice_vllm, prompts)
    want, want_lp = engine_run(novice_plan, prompts)
    assert got == want
    for g, w in zip(got_lp, want_lp):
        assert g == pytest.approx(w, abs=2e-3)
    assert got != engine_run(None, prompts)[0], "the novice plan must change some outputs, or this test could not fail"
    # a decode step hands the kernel only kept experts: a replaced expert's route became weight 0 on a kept one
    for layer, t in call(novice_vllm, route_totals)[0].items():
        assert t["steps"] > 0 and t["experts"] / t["steps"] <= DECODE_POOL, (layer, t)


def test_switching_a_novice_engine_to_the_full_router_and_back(novice_vllm, novice_plan, prompts):
    """``rpc.use_plan`` on the engine the novice plan started: the full router adds zero constants and
    gives the full model's outputs; the plan again its own."""
    try:
        call(novice_vllm, use_plan, None)
        assert vllm_run(novice_vllm, prompts)[0] == engine_run(None, prompts)[0]
    finally:
        call(novice_vllm, use_plan, str(novice_plan), "plan")
    assert vllm_run(novice_vllm, prompts)[0] == engine_run(novice_plan, prompts)[0]
