"""Decode with the compiled kernels (experts in one call, attention read in place from the paged cache)
against decode with torch's ops, on the bundled model: same greedy tokens, same experts read."""
import shutil

import pytest

from engine_helpers import random_prompts
from moetailor import kernels
from moetailor.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the engine runs on torch's kernels")


def decode(native: bool, prompts, max_seqs=8):
    llm = LLM("reference", max_num_seqs=max_seqs, native_kernels=native)
    runner = llm.runner
    assert (runner.native_experts is not None) == (runner.native_attention is not None) == native
    assert (runner.native_linear is not None) == (native and kernels.rows_linear_pays())  # projections, LM head
    assert (runner.native_norm is not None) == native
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    reads = [r.distinct_experts for r in llm.step_log if r.phase == "decode"]
    return [o.token_ids for o in outs], reads


@pytest.mark.parametrize("lengths", [[5, 17, 33, 9], [21]])      # ragged batch; a lone sequence
def test_native_decode_equals_torch_decode(one_thread, lengths):
    prompts = random_prompts(lengths, vocab=8000, seed=len(lengths))
    tokens, reads = decode(True, prompts)
    expected_tokens, expected_reads = decode(False, prompts)
    assert tokens == expected_tokens
    assert reads == expected_reads
