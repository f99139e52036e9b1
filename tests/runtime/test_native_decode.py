"""Decode with the compiled kernels (experts in one call, attention read in place from the paged cache)
against decode with torch's ops, on the bundled model: same greedy tokens, same experts read."""
import shutil

import pytest
from engine_helpers import random_prompts

from moetailor import kernels
from moetailor.serving import LLM, SamplingParams

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


def test_packed_experts_decode_the_same_tokens_as_the_model_layout(one_thread):
    """pack_weights: the engine packs its experts in place, by default only a model it loaded itself
    (a given one with pack_weights=True); the module then holds the packed weights, which the kernel
    also runs outside the engine's steps (``llm.model(ids)``). Same tokens and traffic as the model's
    own layout."""
    import torch

    from moetailor.models.adapters import moe_layers
    from moetailor.models.loading import load_model

    prompts = random_prompts([5, 17, 33, 9], vocab=8000, seed=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(llm):
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], [(r.phase, r.expert_bytes) for r in llm.step_log]

    row_major = LLM("reference", max_num_seqs=8, pack_weights=False)
    expected = run(row_major)
    owned = LLM("reference", max_num_seqs=8, pack_weights=True)
    layer = moe_layers(owned.model)[0]
    assert kernels.is_packed(layer.experts.gate_up_proj) and kernels.is_packed(layer.experts.down_proj)
    assert owned.runner.expert_weights[False][layer.index][0] is layer.experts.gate_up_proj
    assert run(owned) == expected
    ids = torch.tensor([prompts[1]])
    with torch.inference_mode():                                                # the model, called outside a step
        got, want = owned.model(input_ids=ids).logits, row_major.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    model = load_model("reference")
    LLM(model, max_num_seqs=8)                                                  # given: left as it is by default
    assert not kernels.is_packed(moe_layers(model)[0].experts.gate_up_proj)
    assert run(LLM(model, max_num_seqs=8, pack_weights=True)) == expected
    assert kernels.is_packed(moe_layers(model)[0].experts.gate_up_proj)
    assert run(LLM(model, max_num_seqs=8)) == expected                         # a later engine on the packed model


@pytest.mark.parametrize("gemm_hardware", [False, True])
def test_bf16_linears_are_packed_exactly_where_that_pays(one_thread, monkeypatch, gemm_hardware):
    """Without bf16 GEMM hardware torch widens bf16 in software, so the layers are packed for the op;
    with it (oneDNN on AVX512-BF16 / AMX) they are packed only where the op has the bf16 dot product
    itself (``kernels.experts_round_to_bf16``), which beats oneDNN at a decode step's rows."""
    import torch

    from moetailor.runtime import decoder

    monkeypatch.setattr(decoder, "_BF16_GEMM_FAST", [gemm_hardware])
    llm = LLM("reference", dtype=torch.bfloat16, max_num_seqs=4, pack_weights=True)
    q = llm.model.model.layers[0].self_attn.q_proj
    if llm.runner.native_linear is None:
        pytest.skip("the native linear op does not pay on this processor")
    want = not gemm_hardware or kernels.experts_round_to_bf16()
    assert decoder.packed_bf16_linears_pay() == want
    layer = llm.runner.decoder.layers[0]
    assert kernels.is_packed(layer.qkv) == kernels.is_packed(layer.o) == want
    assert not kernels.is_packed(q.weight)                 # copies: transformers' module keeps its layout


def test_bf16_linears_whose_rows_all_run_the_op_are_packed_too(one_thread, monkeypatch):
    """Without bf16 GEMM hardware every row of a bf16 linear layer runs the native op (decode), so the
    engine's decoder reads packed copies of those layers (the experts packed in place); prefill then runs
    them on the op too, and transformers' modules keep their own layout. The tied LM head (the
    embedding's weight too) stays as it is. bf16 rounds differently summed fp32 values, so: the same
    first tokens, logprobs close."""
    import torch

    from moetailor.runtime import decoder as decoder_ops

    monkeypatch.setattr(decoder_ops, "_BF16_GEMM_FAST", [False])      # as on a CPU without AVX512-BF16 / AMX
    prompts = random_prompts([5, 17, 9], vocab=8000, seed=4)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    plain = LLM("reference", dtype=torch.bfloat16, max_num_seqs=8, pack_weights=False)
    packed = LLM("reference", dtype=torch.bfloat16, max_num_seqs=8, pack_weights=True)
    q = packed.model.model.layers[0].self_attn.q_proj
    decoder = packed.runner.decoder
    assert kernels.is_packed(decoder.layers[0].qkv) and not kernels.is_packed(decoder.lm_head)
    assert not kernels.is_packed(q.weight)
    for a, b in zip(plain.generate(prompts, params), packed.generate(prompts, params)):
        assert a.token_ids[:2] == b.token_ids[:2]
        torch.testing.assert_close(torch.tensor([e.logprob for e in b.logprobs[:2]]),
                                   torch.tensor([e.logprob for e in a.logprobs[:2]]), atol=0.05, rtol=0)
    attn = packed.model.model.layers[0].self_attn                   # the copy holds the model's values
    assert torch.equal(kernels.unpack_weight(decoder.layers[0].qkv),
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


def test_fp32_olmoe_projections_are_packed_copies_for_its_decoder(one_thread):
    """An engine that packs (AVX-512) gives fp32 OLMoE's decoder packed copies of its projections (the
    fp32 Qwen-MoE decoder reads them row-major); greedy outputs equal the checkpoint layout's, and
    transformers' modules keep their weights, so the model still computes outside the engine's steps."""
    import copy

    import torch

    from moetailor.models.tiny import tiny_model

    model = tiny_model("olmoe", seed=5)
    reference = copy.deepcopy(model)
    prompts = random_prompts([5, 17, 9], seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    packs = LLM(model, block_size=4, pack_weights=True)
    plain = LLM(reference, block_size=4, pack_weights=False)
    q = model.model.layers[0].self_attn.q_proj
    if packs.runner.native_linear is None or packs.runner.expert_weights[True] is None:
        pytest.skip("this processor's engine does not pack")
    layer = packs.runner.decoder.layers[0]
    assert kernels.is_packed(layer.qkv) and kernels.is_packed(layer.o) and not kernels.is_packed(q.weight)
    assert not kernels.is_packed(layer.moe_in)                                    # the router stays
    assert [o.token_ids for o in packs.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    ids = torch.tensor([prompts[1]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    lean = LLM("reference", max_num_seqs=4)                                       # owned: packs, engine decoder on
    layer = lean.model.model.layers[0].self_attn
    assert lean.runner.decoder is not None and not kernels.is_packed(layer.o_proj.weight)
    assert not kernels.is_packed(lean.runner.decoder.layers[0].o)                 # fp32 Qwen-MoE: row-major
