"""The bundled model exported by `moetailor export gguf` and run by llama.cpp: it tokenizes as the bundled
tokenizer does, and its last-token logits and greedy outputs equal moetailor's fp32 engine on the same
weights (full, pruned, fewer experts per token, and prefill/decode from two files)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from llamacpp_helpers import ASSETS, MAX_TOKENS, SKIP_REASON, TOLERANCE, engine_run, heldout_texts, top_logprob_gap

pytest.importorskip("llama_cpp", reason=SKIP_REASON)

from moetailor.integrations.llamacpp import BatchedDecoder, greedy, last_logits, load, phase_aware_greedy, tokenize  # noqa: E402

EOS = {0}


@pytest.fixture(scope="module")
def full(exported):
    return load(exported["f32"])


@pytest.fixture(scope="module")
def pruned(exported):
    return load(exported["pruned"])


@pytest.fixture(scope="module")
def engine(unnormalised):
    from moetailor.serving import LLM

    return LLM(str(unnormalised))


def test_tokenizes_as_the_bundled_tokenizer(full, prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS / "reference")
    texts = prompts + heldout_texts() + ["x  1", "a\n\n  22 b", "  007 '  s' 3.14\t\t9"]   # spaces before digits
    for text in texts:
        assert tokenize(full, text) == tok.encode(text, add_special_tokens=False), text[:60]


def test_full_model_matches_the_engine(full, engine, prompts):
    want, firsts, prompt_ids = engine_run(engine, prompts)
    for ids, first, expected in zip(prompt_ids, firsts, want):
        logits = last_logits(full, ids)                                          # [V]
        with torch.inference_mode():
            ref = engine.model(torch.tensor([ids])).logits[0, -1].numpy()        # the engine's model, same weights
        assert float(np.abs(logits - ref).max()) < TOLERANCE
        assert top_logprob_gap(first, logits) < TOLERANCE
        assert greedy(full, ids, MAX_TOKENS, EOS) == expected


def test_pruned_file_matches_the_engine_with_the_plan(pruned, full, unnormalised, plans, prompts):
    from moetailor.serving import LLM

    want, firsts, prompt_ids = engine_run(LLM(str(unnormalised), plans["both"]), prompts)
    got = [greedy(pruned, ids, MAX_TOKENS, EOS) for ids in prompt_ids]
    assert got == want
    assert got != [greedy(full, ids, MAX_TOKENS, EOS) for ids in prompt_ids]     # the plan changes outputs
    for ids, first in zip(prompt_ids, firsts):
        assert top_logprob_gap(first, last_logits(pruned, ids)) < TOLERANCE


def test_override_kv_matches_the_engines_expert_budget(exported, engine, prompts):
    want, firsts, prompt_ids = engine_run(engine, prompts, expert_top_k=4)
    four = load(exported["f32"], top_k=4)                      # --override-kv qwen2moe.expert_used_count=int:4
    got = [greedy(four, ids, MAX_TOKENS, EOS) for ids in prompt_ids]
    assert got == want
    assert got != engine_run(engine, prompts)[0]
    for ids, first in zip(prompt_ids, firsts):
        assert top_logprob_gap(first, last_logits(four, ids)) < TOLERANCE


def test_phase_aware_across_two_files_matches_the_engine(full, pruned, unnormalised, plans, prompts):
    """Prefill in the full file, decode in the pruned one (the KV cache moves by llama.cpp's state API):
    what the engine computes with the decode-only plan."""
    from moetailor.serving import LLM

    want, _, prompt_ids = engine_run(LLM(str(unnormalised), plans["decode"]), prompts)
    got = [phase_aware_greedy(full, pruned, ids, MAX_TOKENS, EOS) for ids in prompt_ids]
    assert got == want
    assert got != [greedy(pruned, ids, MAX_TOKENS, EOS) for ids in prompt_ids]


def test_the_routing_difference_the_export_refuses_by_default_is_real(full, prompts):
    """On the bundled model as trained (norm_topk_prob=true) llama.cpp computes another function."""
    from moetailor.serving import LLM

    _, firsts, prompt_ids = engine_run(LLM("reference"), prompts[:4], max_tokens=1)
    gaps = [top_logprob_gap(first, last_logits(full, ids)) for ids, first in zip(prompt_ids, firsts)]
    assert min(gaps) > 100 * TOLERANCE


def test_batched_decoding_equals_one_sequence_at_a_time(full, engine, prompts):
    from moetailor.serving import SamplingParams

    ids = [engine.encode(p)[1] for p in prompts[:6]]
    with BatchedDecoder(full, max_seqs=6, n_ctx=1024) as batched:
        got = batched.generate(ids, 12)
    assert got == [list(o.token_ids) for o in engine.generate(
        ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]


def test_reduced_precision_files(exported, full, prompts):
    """bf16 and q8_0 files load, hold their tensor type, and stay close to the f32 file."""
    import gguf

    ids = tokenize(full, prompts[0])
    ref = last_logits(full, ids)
    for outtype, tolerance in (("bf16", 0.5), ("q8_0", 0.5)):
        kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(exported[outtype])).tensors if len(t.shape) > 1}
        assert outtype.upper() in kinds
        got = last_logits(load(exported[outtype]), ids)
        assert float(np.abs(got - ref).max()) < tolerance
        assert int(np.argmax(got)) == int(np.argmax(ref))


def test_metadata(exported, plans):
    import json

    import gguf

    def fields(path):
        reader = gguf.GGUFReader(str(path))
        return {k: f.contents() for k, f in reader.fields.items()}, {t.name for t in reader.tensors}

    full_kv, full_tensors = fields(exported["f32"])
    kv, tensors = fields(exported["pruned"])
    assert "output.weight" in full_tensors and "output.weight" in tensors        # untied for qwen2moe's loader
    assert full_kv["qwen2moe.expert_count"] == 64 and kv["qwen2moe.expert_count"] == 16
    assert kv["qwen2moe.expert_used_count"] == 8
    assert kv["tokenizer.ggml.pre"] == "refact" and kv["tokenizer.ggml.add_bos_token"] is False
    plan = json.loads(plans["decode"].read_text())
    assert [kv[f"moetailor.kept.{i}"] for i in range(6)] == [plan["decode"][str(i)]["keep"] for i in range(6)]
    assert kv["moetailor.num_experts_original"] == 64 and kv["moetailor.phase"] == "decode"
