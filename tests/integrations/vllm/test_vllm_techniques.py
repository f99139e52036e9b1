"""Every engine technique inside vLLM, in its default compiled mode and with enforce_eager: one plan
stacks them over the bundled model's six MoE layers (prefill top-K' with fold targets and scales;
decode fold, drop and mask pools, dynamic skipping, token pools, a batch-level fold pool, per-layer
top_k, several in one layer), and a batch mixes per-request budgets. Outputs equal moetailor's
engine token for token, and the experts each decode step reads (recorded from the routes vLLM's
kernel gets) equal those the engine's experts read: dropped routes cost nothing."""
from __future__ import annotations

import json

import pytest
from vllm_helpers import BUNDLED_PLAN, SKIP_REASON, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)

from moetailor.integrations.vllm.rpc import call, route_totals, use_plan  # noqa: E402

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stacked_plan(tmp_path_factory):
    from moetailor.calibration import calibrate
    from moetailor.models import load_model, load_tokenizer

    out = tmp_path_factory.mktemp("techniques")
    stats = calibrate(load_model("reference"), load_tokenizer("reference"), "tasks", 1024, batch_tokens=512,
                      seq_len=128, fold=True, progress=False)
    stats_path = stats.save(out / "fold.safetensors")
    data = json.loads(BUNDLED_PLAN.read_text())
    keep = {i: layer["keep"] for i, layer in data["decode"].items()}   # REAP order, best first
    data["prefill"] = {"0": {"token_keep": 5}, "3": {"top_k": 6}}
    data["decode"] = {
        "0": {"keep": keep["0"][:16], "pool_mode": "fold"},
        "1": {"keep": keep["1"][:24], "pool_mode": "drop"},
        "2": {"skip_beta": 0.3},
        "3": {"token_keep": 4},
        "4": {"batch_pool": 20},
        "5": {"keep": keep["5"][:24], "top_k": 5, "skip_beta": 0.15},
    }
    data["fold_stats"] = str(stats_path)
    plan = out / "stacked.json"
    plan.write_text(json.dumps(data))
    return plan


@pytest.fixture(scope="module", params=["compiled", "eager"])
def stacked_vllm(request, stacked_plan):
    from moetailor.integrations.vllm.launch import engine_kwargs

    # Every prompt prefills in the first step, then all decode together: the engine's steps exactly,
    # so its batch-level pool ranks the same tokens. That needs vLLM's engine core in this process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0): in its own process it starts stepping when the first request
    # arrives, so step 0 held one prompt and request 0 then decoded one step ahead of the others, in
    # every batch the pool ranked (2026-12-02: request 7 then differed; the xfails this replaced).
    kwargs = engine_kwargs("reference", plan=stacked_plan, kv_cache_mib=128, max_num_batched_tokens=512,
                           max_num_seqs=16, enforce_eager=request.param == "eager")
    kwargs["additional_config"]["moetailor_record_routes"] = True
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        with vllm_engine(**kwargs) as llm:
            yield llm
    finally:
        patch.undo()


def engine_run(plan_path, prompts, ks):
    from moetailor.plans import Plan
    from moetailor.serving import LLM, SamplingParams

    llm = LLM("reference", Plan.load(plan_path) if plan_path else None)
    out = llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, expert_top_k=k) for k in ks])
    decode = [r.distinct_experts for r in llm.step_log if r.phase == "decode"]
    return [list(o.token_ids) for o in out], decode


def vllm_run(llm, prompts, ks):
    call(llm, route_totals, reset=True)
    got = vllm_token_ids(llm, prompts, [None if k is None else {"expert_top_k": k} for k in ks], MAX_TOKENS)
    return got, call(llm, route_totals)[0]


@pytest.mark.parametrize("budgets", ["none", "mixed"])
def test_stacked_techniques_and_budgets_equal_engine(stacked_vllm, stacked_plan, prompts, budgets):
    ks = [None] * len(prompts) if budgets == "none" else [(2, None, 5, 1)[i % 4] for i in range(len(prompts))]
    expected, engine_steps = engine_run(stacked_plan, prompts, ks)
    got, totals = vllm_run(stacked_vllm, prompts, ks)
    assert got == expected
    full = engine_run(None, prompts, ks)[0] if budgets == "none" else None
    if full is not None:
        assert got != full, "the plan must change outputs, or this test could not fail"
    # distinct experts summed over decode steps, per MoE layer: a dropped route makes vLLM's kernel read
    # no expert the engine's experts do not read, and vLLM reads every one they do
    assert {l: t["steps"] for l, t in totals.items()} == {l: len(engine_steps) for l in totals}
    assert {l: t["experts"] for l, t in totals.items()} == {l: sum(s[l] for s in engine_steps) for l in totals}


def test_budgets_cut_the_experts_vllm_reads(stacked_vllm, prompts):
    """The same batch at k=2 reads fewer experts per decode step than at full k, in every layer."""
    full = vllm_run(stacked_vllm, prompts, [None] * len(prompts))[1]
    cut = vllm_run(stacked_vllm, prompts, [2] * len(prompts))[1]
    for layer in full:
        per_step = lambda t: t[layer]["experts"] / t[layer]["steps"]
        assert per_step(cut) < per_step(full), (layer, per_step(cut), per_step(full))


def test_a_running_engine_switches_plans_between_requests(stacked_vllm, stacked_plan, prompts, tmp_path):
    """``rpc.use_plan`` (how ``bench vllm`` times every plan on one engine and ``eval --backend vllm``
    scores them): the full router gives the full model's outputs, a plan that narrows a layer's
    emitted width (its top_k) runs padded with weight-0 routes and gives the engine's outputs for it,
    the plan again its own."""
    ks = [None] * len(prompts)
    try:
        assert call(stacked_vllm, use_plan, None) == ["full router"]
        assert vllm_run(stacked_vllm, prompts, ks)[0] == engine_run(None, prompts, ks)[0]
        narrow = json.loads(stacked_plan.read_text())
        narrow["prefill"]["5"] = narrow["decode"]["5"] = {"top_k": 4}
        (tmp_path / "narrow.json").write_text(json.dumps(narrow))
        call(stacked_vllm, use_plan, str(tmp_path / "narrow.json"), "plan")
        got = vllm_run(stacked_vllm, prompts, ks)[0]
        assert got == engine_run(tmp_path / "narrow.json", prompts, ks)[0]
        assert got != engine_run(stacked_plan, prompts, ks)[0], "the narrowed layer must change some outputs"
    finally:
        call(stacked_vllm, use_plan, str(stacked_plan), "plan")
    assert vllm_run(stacked_vllm, prompts, ks)[0] == engine_run(stacked_plan, prompts, ks)[0]
