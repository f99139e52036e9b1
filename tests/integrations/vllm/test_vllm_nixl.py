"""The disaggregated pair on vLLM's own connector (NixlConnector, UCX on CPU): prefill on the full
model, decode on the pruned checkpoint, vLLM's do_remote_decode / do_remote_prefill flow; outputs
equal moetailor's phase-aware engine. Needs the `nixl` package (`make setup-vllm-nixl`)."""
from __future__ import annotations

import contextlib
import os

import pytest
from vllm_helpers import MAX_TOKENS, SKIP_REASON, engine_token_ids, vllm_engine, vllm_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)
from moetailor.integrations.vllm import nixl  # noqa: E402

if not nixl.nixl_available():
    pytest.skip("the `nixl` package is not installed in vLLM's environment: run `make setup-vllm-nixl`",
                allow_module_level=True)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, quarter_plan):
    from moetailor.transforms import prune_checkpoint

    return prune_checkpoint("reference", quarter_plan, tmp_path_factory.mktemp("vllm") / "pruned")


@pytest.fixture(scope="module")
def pair(pruned):
    prefill, decode = nixl.pair_kwargs("reference", pruned, kv_cache_mib=128, max_num_seqs=8)
    with contextlib.ExitStack() as stack:
        engines = []
        for kw, port in ((prefill, 5731), (decode, 5741)):
            os.environ.update(nixl.side_channel_env(port))   # read by the engine-core process it starts
            engines.append(stack.enter_context(vllm_engine(**kw)))
        yield engines


@pytest.fixture(scope="module")
def token_ids(prompts):
    from moetailor.serving import LLM

    tok = LLM("reference").tokenizer
    return [tok.encode(p) for p in prompts]


def test_nixl_pair_equals_phase_aware_engine(pair, token_ids, quarter_plan):
    from vllm import SamplingParams

    from moetailor.plans import Plan

    prefill_llm, decode_llm = pair
    expected = engine_token_ids(Plan.load(quarter_plan).phase_aware(), token_ids)
    assert expected != engine_token_ids(None, token_ids), "the plan must change outputs to be tested"
    got = nixl.generate_pair(prefill_llm, decode_llm, token_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert got == expected
    # the pruned decoder alone gives other outputs: the pulled KV is what makes the pair phase-aware
    assert vllm_token_ids(decode_llm, [{"prompt_token_ids": i} for i in token_ids]) != expected


def test_prefill_returns_vllm_transfer_params(pair, token_ids):
    """vLLM's flow: a do_remote_decode request comes back with the blocks and the side channel to pull from."""
    from vllm import SamplingParams

    out = pair[0].generate([{"prompt_token_ids": token_ids[0]}],
                           nixl.prefill_params(SamplingParams(max_tokens=8, temperature=0.0)), use_tqdm=False)[0]
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_block_ids"] and params["remote_port"] == 5731
    assert params["remote_num_tokens"] == len(token_ids[0])
    assert len(out.outputs[0].token_ids) == 1


def test_nixl_pair_refuses_a_checkpoint_that_is_not_a_pruning(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a `moetailor prune` checkpoint"):
        nixl.pair_kwargs("reference", tmp_path)
