"""A merged checkpoint as the decode half of vLLM's disaggregated pair: prefill on the full model, decode
on `moetailor prune`'s M-SMoE checkpoint (16 merged experts per layer, a stock Qwen2-MoE checkpoint)
continuing the prompt's KV through moetailor's connector. Outputs equal moetailor's own disaggregated
engine on the same two checkpoints (`DisaggregatedLLM`, how `eval` serves a merged plan), differ from
the full model's, and differ from the merged checkpoint decoding its own prefill."""
from __future__ import annotations

import contextlib

import pytest

from vllm_helpers import MAX_TOKENS, SKIP_REASON, engine_token_ids, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    from moetailor.calibration import calibrate
    from moetailor.cli.main import main
    from moetailor.models import load_model, load_tokenizer
    from moetailor.plans.criteria import make_plan

    root = tmp_path_factory.mktemp("merged")
    model = load_model("reference")
    stats = calibrate(model, load_tokenizer("reference"), "tasks", 1024, batch_tokens=512, seq_len=128, progress=False)
    plan = make_plan(stats, model, "frequency", keep_experts=16, merge="msmoe").save(root / "plan.json")
    assert main(["prune", "reference", str(plan), "--out", str(root / "merged")]) == 0
    return root / "merged"


@pytest.fixture(scope="module")
def pair(merged, tmp_path_factory):
    from moetailor.integrations.vllm.disagg import pair_kwargs

    storage = tmp_path_factory.mktemp("kv")
    prefill, decode = pair_kwargs("reference", merged, storage, kv_cache_mib=128, max_num_seqs=8)
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(vllm_engine(**prefill)), stack.enter_context(vllm_engine(**decode))


def test_pair_with_a_merged_decoder_equals_the_engines_pair(pair, merged, prompts):
    from vllm import SamplingParams

    from moetailor.serving import LLM, SamplingParams as EngineParams
    from moetailor.serving.disagg import DisaggregatedLLM
    from moetailor.integrations.vllm.disagg import generate_pair
    from moetailor.transforms import read_sidecar

    assert read_sidecar(merged)["merged"], "a merged checkpoint, not a pruned one"
    ids = [LLM("reference").tokenizer.encode(p) for p in prompts]
    with DisaggregatedLLM("reference", decode_model=str(merged)) as engine:
        expected = [list(o.token_ids) for o in engine.generate(ids, EngineParams(max_tokens=MAX_TOKENS,
                                                                                temperature=0.0))]
    assert expected != engine_token_ids(None, ids), "the merged decoder must change outputs to be tested"
    prefill_llm, decode_llm = pair
    got = generate_pair(prefill_llm, decode_llm, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert got == expected
    # the merged checkpoint alone (its own prefill) gives other outputs: the full model's KV is reused
    assert vllm_token_ids(decode_llm, [{"prompt_token_ids": i} for i in ids]) != expected
