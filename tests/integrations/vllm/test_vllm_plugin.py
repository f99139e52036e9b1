"""The general plugin: phase-aware routing and per-request expert budgets inside vLLM equal
moetailor's own engine, token for token (fp32 greedy, bundled reference model), in vLLM's default
compiled mode (on CPU: one Dynamo trace, guards dropped) and with enforce_eager."""
from __future__ import annotations

import pytest
from vllm_helpers import SKIP_REASON, engine_token_ids, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)

from moetailor.integrations.vllm.rpc import call, experts_kernel_layers  # noqa: E402


@pytest.fixture(scope="module", params=["compiled", "eager", "compiled, moetailor experts kernel"])
def phase_aware_vllm(request, quarter_plan):
    """The third engine runs its MoE layers on moetailor's experts kernel (``experts.py``), which
    skips the weight-0 routes budgets leave: outputs must not change."""
    from moetailor.integrations.vllm.launch import engine_kwargs

    # 32 tokens per step: prompts are split into chunks and decode tokens of early requests share
    # steps with prefill chunks of later ones (the per-token phase is what the plugin must get right)
    kwargs = engine_kwargs("reference", decode_plan=quarter_plan, kv_cache_mib=128, max_num_batched_tokens=32,
                           max_num_seqs=8, enforce_eager=request.param == "eager",
                           experts_kernel="experts kernel" in request.param)
    assert kwargs["enable_prefix_caching"] is False
    with vllm_engine(**kwargs) as llm:
        if "experts kernel" in request.param:
            assert call(llm, experts_kernel_layers) == [6], "every MoE layer on moetailor's kernel"
            from moetailor import kernels  # its experts packed as the engine holds them, where that pays
            assert call(llm, experts_kernel_layers, True) == \
                [6 if kernels.packed_weights_pay() else 0]
        yield llm


@pytest.fixture(scope="module")
def plan(quarter_plan):
    from moetailor.plans import Plan

    p = Plan.load(quarter_plan)
    return p.phase_aware()


def test_phase_aware_equals_moetailor_engine_under_chunked_prefill(phase_aware_vllm, plan, prompts):
    expected = engine_token_ids(plan, prompts)
    full = engine_token_ids(None, prompts)
    got = vllm_token_ids(phase_aware_vllm, prompts)
    assert got == expected
    assert got != full, "the decode plan must change some outputs, or this test could not fail"


def test_per_request_expert_top_k_equals_moetailor_engine(phase_aware_vllm, plan, prompts):
    """Budgets mixed in one batch (and with requests that set none): each request gets its own k."""
    ks = [(2, 4, None)[i % 3] for i in range(len(prompts))]
    expected = engine_token_ids(plan, prompts, expert_top_k=ks)
    got = vllm_token_ids(phase_aware_vllm, prompts, [None if k is None else {"expert_top_k": k} for k in ks])
    assert got == expected
    assert [g for g, k in zip(got, ks) if k] != [e for e, k in zip(engine_token_ids(plan, prompts), ks) if k]


@pytest.mark.parametrize("k", [0, 9, "four"])
def test_expert_top_k_out_of_range_is_refused_at_admission(phase_aware_vllm, k):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"expert_top_k.*(out of range|must be an integer)"):
        phase_aware_vllm.generate(["add 1 + 2"], SamplingParams(max_tokens=2, extra_args={"expert_top_k": k}))
