"""Preemption on the pruned decode instance of the vLLM pair. vLLM (V1) preempts a running request
by freeing its blocks and recomputes it on resumption; MoetailorConnector keeps the prompt's
full-model KV files until the request ends and loads them again into the resumed request's new
blocks, so only the generated tokens are recomputed, on the pruned model, as in moetailor's
phase-aware engine. Without that reload vLLM would recompute the prompt on the pruned model
(NixlConnector's behaviour once its one pull is done) and the resumed request's output changes:
the second test shows it with a connector that skips the reload. The third sends one prompt several
times: each decode request loads its own stored copy, however late it runs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_helpers import MAX_TOKENS, SKIP_REASON, engine_token_ids, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)

BLOCK_SIZE = 32
DECODE_BLOCKS = 5       # 160 tokens of decode cache for 12 requests of up to ~93 tokens: vLLM must preempt
COPIES = 3              # identical prompts in flight together
KV_BYTES = 64 << 20     # the CPU backend's cache allocation; num_gpu_blocks_override caps the blocks used


@pytest.fixture(scope="module")
def case(quarter_plan, prompts, tmp_path_factory):
    """The pair's prefill instance (full model, started once) and what each decode instance needs.
    The decode model keeps a quarter of the experts (`quarter_plan`): the bundled 50% plan leaves
    these prompts' outputs unchanged, so a wrong prompt recompute could not show with it."""
    from moetailor.integrations.vllm.disagg import pair_kwargs
    from moetailor.plans import Plan
    from moetailor.serving import LLM
    from moetailor.transforms import prune_checkpoint

    tmp = tmp_path_factory.mktemp("preempt")
    pruned = prune_checkpoint("reference", quarter_plan, tmp / "pruned-25")
    ids = [LLM("reference").tokenizer.encode(p) for p in prompts]
    expected = engine_token_ids(Plan.load(quarter_plan).phase_aware(), ids)
    storage = tmp / "kv"
    prefill_kw, decode_kw = pair_kwargs("reference", pruned, storage, kv_cache_mib=None, max_num_seqs=8,
                                        block_size=BLOCK_SIZE, max_model_len=128)
    decode_kw.update(kv_cache_memory_bytes=KV_BYTES, num_gpu_blocks_override=DECODE_BLOCKS, disable_log_stats=False)
    with vllm_engine(**prefill_kw, kv_cache_memory_bytes=KV_BYTES) as prefill_llm:
        yield SimpleNamespace(prefill=prefill_llm, decode_kw=decode_kw, ids=ids, expected=expected, storage=storage)


def run_with_decode(case, **decode_overrides) -> tuple[list[list[int]], list, int]:
    """The pair's outputs, the decode instance's RequestOutputs, and its vLLM preemption count."""
    from vllm import SamplingParams

    from moetailor.integrations.vllm.disagg import run_pair

    with vllm_engine(**{**case.decode_kw, **decode_overrides}) as decode_llm:
        got, decoded = run_pair(case.prefill, decode_llm, case.ids,
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        preempted = sum(m.value for m in decode_llm.get_metrics() if m.name == "vllm:num_preemptions")
    return got, decoded, int(preempted)


def test_preempted_decode_requests_reload_their_prompt_kv_and_equal_phase_aware_engine(case):
    got, decoded, preempted = run_with_decode(case)
    loads = [o.kv_transfer_params["moetailor_kv_loads"] for o in decoded if o is not None]
    reloads = sum(n - 1 for n in loads)
    print(f"decode instance: {preempted} preemptions, {reloads} prompt-KV reloads over {len(loads)} requests; "
          f"{sum(g != e for g, e in zip(got, case.expected))} of {len(got)} outputs differ from the engine")
    assert preempted > 0, "the decode instance never preempted: the test did not test resumption"
    assert len(loads) == len(decoded) and min(loads) >= 1, "every decode request loads its prompt's KV"
    assert reloads == preempted, "each preempted request loads its prompt's KV again when it resumes"
    assert got == case.expected
    assert not any(case.storage.iterdir()), "the decode instance frees each prompt's stored KV when the request ends"


def test_without_the_reload_a_preempted_request_changes_its_output(case):
    """The mutation that shows the first test can fail: a connector that gives a resumed request no
    KV (vLLM then recomputes its prompt on the pruned model) no longer equals the engine."""
    transfer = {**case.decode_kw["kv_transfer_config"], "kv_connector": "NoReloadConnector",
                "kv_connector_module_path": "vllm_noreload_connector"}
    got, _, preempted = run_with_decode(case, kv_transfer_config=transfer)
    differ = sum(g != e for g, e in zip(got, case.expected))
    print(f"no reload: {preempted} preemptions, {differ} of {len(got)} outputs differ from the engine")
    assert preempted > 0
    assert got != case.expected


def test_identical_prompts_in_flight_each_load_the_prompt_kv(case):
    """One prompt sent COPIES times, the decode instance running one request at a time
    (max_num_seqs=1): a later copy is scheduled only after an earlier one ended, and must still load
    the prompt's full-model KV. With one folder per prompt, the first copy to end deleted it and vLLM
    silently computed the later copies' prompt on the pruned model."""
    from vllm import SamplingParams

    from moetailor.integrations.vllm.disagg import run_pair

    assert not any(case.storage.iterdir())
    with vllm_engine(**{**case.decode_kw, "max_num_seqs": 1}) as decode_llm:
        # a prompt whose recompute on the pruned model changes its output (nothing stored: the
        # decode instance computes P + [t1] itself), so a copy that loads nothing shows
        i = next((i for i, (ids, want) in enumerate(zip(case.ids, case.expected)) if len(want) > 1 and
                  vllm_token_ids(decode_llm, [{"prompt_token_ids": ids + want[:1]}], max_tokens=MAX_TOKENS - 1)[0]
                  != want[1:]), None)
        assert i is not None, "no prompt changes when recomputed on the pruned model: the test could not fail"
        got, decoded = run_pair(case.prefill, decode_llm, [case.ids[i]] * COPIES,
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    loads = [(o.kv_transfer_params or {}).get("moetailor_kv_loads", 0) if o else 0 for o in decoded]
    print(f"prompt {i} x {COPIES}: prompt-KV loads per decode request {loads}; "
          f"{sum(g != case.expected[i] for g in got)} of {COPIES} outputs differ from the engine")
    assert got == [case.expected[i]] * COPIES
    assert min(loads) >= 1, "every copy loads its prompt's KV"
    assert not any(case.storage.iterdir()), "the last copy to end leaves no stored KV behind"
