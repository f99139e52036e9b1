"""Engine core: greedy equals transformers, phase-aware decode equals a cache hand-over reference,
preemption, abort, streaming, sampling and request validation (tiny models)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts, stock_handover, stock_pruned_twin, stock_twin

from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams

LENGTHS = [3, 9, 17, 5, 1, 12, 30, 7]


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral"])
def test_greedy_matches_transformers_batch_8_mixed_lengths(arch):
    model = tiny_model(arch)
    reference = stock_twin(model)
    prompts = random_prompts(LENGTHS)
    llm = LLM(model, block_size=4, num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(reference, prompt, 8), f"{arch}: prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.prompt_token_ids == prompt
    assert llm.block_manager.num_free == 128  # every block came back


def teacher_forced_gap(reference, prompt: list[int], out) -> float:
    """Largest |engine logprob - stock logprob| over the engine's generated tokens, the stock model
    scoring the engine's own sequence in one forward."""
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)   # [T, V]
    return max(abs(e.logprob - ref[len(prompt) - 1 + j, ids[len(prompt) + j]].item()) for j, e in enumerate(out.logprobs))


NATIVE_BF16_GAP = pytest.mark.xfail(
    strict=True, reason="the native bf16 kernels compute with fp32 activations where transformers rounds each bf16 "
                        "op, so a near-tie routes differently: a 0.15 logprob gap on this tiny qwen3_moe")


@pytest.mark.parametrize("arch, native", [(arch, False) for arch in TINY_ARCHITECTURES] + [
    pytest.param(arch, True, marks=NATIVE_BF16_GAP if arch == "qwen3_moe" else ()) for arch in TINY_ARCHITECTURES])
def test_bf16_engine_against_transformers_in_bf16(arch, native):
    """A bf16 checkpoint against stock transformers in bf16, one prompt at a time: the prompt's first
    token equal, and every generated token's logprob within bf16 rounding of the stock model's score
    of the same sequence (greedy sequences may part at near-ties, where one rounding decides)."""
    model = tiny_model(arch, seed=2).to(torch.bfloat16)
    reference = stock_twin(model)
    prompts = random_prompts([3, 9, 17, 5], seed=2)
    llm = LLM(model, block_size=4, native_kernels=native)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0))
    assert [o.token_ids[0] for o in outs] == [hf_greedy(reference, p, 1)[0] for p in prompts]
    gaps = [teacher_forced_gap(reference, p, o) for p, o in zip(prompts, outs)]
    assert max(gaps) < 0.02, gaps


def test_greedy_matches_transformers_batch_1():
    model = tiny_model("qwen2_moe", seed=3)
    reference = stock_twin(model)
    prompt = random_prompts([11], seed=3)[0]
    out = LLM(model, block_size=4).generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(reference, prompt, 20)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_phase_aware_decode_matches_cache_handover(arch):
    """The masked decode pool equals SlimWise's pair of stock models: transformers' full model prefills, its
    cache goes to the stock pruned checkpoint of the plan, which decodes."""
    model = tiny_model(arch, seed=1)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5)))
    full_ref, pruned_ref = stock_twin(model), stock_pruned_twin(model, plan)
    prompts = random_prompts([4, 13, 8], seed=1)
    llm = LLM(model, plan, block_size=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    full = LLM(model, block_size=4).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == stock_handover(full_ref, pruned_ref, prompt, 10)
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, full)), "the plan should change some output"
    decode = [r for r in llm.step_log if r.phase == "decode"]
    prefill = [r for r in llm.step_log if r.phase == "prefill"]
    assert decode and all(max(r.distinct_experts.values()) <= 3 for r in decode)
    assert all(r.expert_bytes > 0 for r in decode)
    assert max(prefill[0].distinct_experts.values()) > 3   # prefill ran the full pool


def test_per_request_expert_top_k_equals_plan_top_k():
    """A per-request budget, a plan's top-k and a stock model configured with that top-k agree, and differ
    from the full budget."""
    model = tiny_model("qwen2_moe", seed=2)
    top1 = stock_twin(model, num_experts_per_tok=1)
    prompts = random_prompts([6, 10], seed=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plan = uniform_plan(model, decode=LayerPolicy(top_k=1), prefill=LayerPolicy(top_k=1))
    by_plan = LLM(model, plan).generate(prompts, params)
    by_request = LLM(model).generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True, expert_top_k=1),
                                               SamplingParams(max_tokens=6, ignore_eos=True, expert_top_k=1)])
    full = LLM(model).generate(prompts, params)
    assert [o.token_ids for o in by_plan] == [o.token_ids for o in by_request] == [hf_greedy(top1, p, 6) for p in prompts]
    assert [o.token_ids for o in by_request] != [o.token_ids for o in full], "top-1 should change some output"


def test_pool_exhaustion_preempts_and_every_request_finishes():
    model = tiny_model("qwen2_moe")
    prompts = random_prompts([10, 12, 9, 11, 8, 10])
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    roomy = LLM(model, block_size=4, num_kv_blocks=200).generate(prompts, params)
    tight = LLM(model, block_size=4, num_kv_blocks=14)   # 6 x 6 blocks wanted at the end, 14 available
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "length" for o in outs)
    assert tight.block_manager.num_free == 14


def test_abort_frees_blocks():
    llm = LLM(tiny_model("qwen2_moe"), block_size=4, num_kv_blocks=64)
    a = llm.add_request(random_prompts([10])[0], SamplingParams(max_tokens=30, ignore_eos=True), request_id="a")
    b = llm.add_request(random_prompts([6])[0], SamplingParams(max_tokens=30, ignore_eos=True), request_id="b")
    for _ in range(3):
        llm.step()
    assert llm.block_manager.num_free < 64
    assert llm.abort("a") and not llm.abort("a")
    assert a.finish_reason == "abort" and llm.block_manager.num_free == 64 - len(b.block_table)
    llm.abort("b")
    assert llm.block_manager.num_free == 64 and not llm.has_unfinished()


def test_stream_matches_generate_and_early_close_frees_blocks():
    model = tiny_model("qwen2_moe")
    prompt = random_prompts([7])[0]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    llm = LLM(model, block_size=4, num_kv_blocks=32)
    deltas = list(llm.stream(prompt, params))
    assert sum((d.token_ids for d in deltas), []) == llm.generate([prompt], params)[0].token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    it = llm.stream(prompt, params)
    next(it), next(it)
    assert llm.block_manager.num_free < 32
    it.close()
    assert llm.block_manager.num_free == 32


def test_sampling_seed_top_k_and_stop(tokenizer):
    model = tiny_model("qwen2_moe", vocab=128)
    llm = LLM(model, tokenizer=tokenizer)
    prompt = "abc def"
    hot = dict(max_tokens=12, temperature=1.5, ignore_eos=True)
    a, b, c = llm.generate([prompt] * 3, [SamplingParams(**hot, seed=1), SamplingParams(**hot, seed=1),
                                          SamplingParams(**hot, seed=2)])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    top1 = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, top_k=1, seed=5, ignore_eos=True))[0]
    tiny_p = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, top_p=1e-6, seed=5,
                                                   ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids == tiny_p.token_ids
    assert greedy.text == tokenizer.decode(greedy.token_ids, skip_special_tokens=True)
    stop = greedy.text[3:5]
    cut = llm.generate([prompt], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == greedy.text[:greedy.text.find(stop)]


def test_eos_stops_unless_ignored():
    model = tiny_model("qwen2_moe")
    llm = LLM(model)
    prompt = random_prompts([5])[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    llm.eos_token_ids = {free.token_ids[3]}
    first = free.token_ids.index(free.token_ids[3])
    out = llm.generate([prompt], SamplingParams(max_tokens=10))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]


def test_bad_requests_name_the_problem():
    llm = LLM(tiny_model("qwen2_moe"), max_model_len=64)
    with pytest.raises(ValueError, match="context limit of 64"):
        llm.add_request(list(range(2, 62)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.add_request([5, 500])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.add_request("text without a tokenizer")
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[5, 6]], [SamplingParams(), SamplingParams()])
    assert not llm.has_unfinished()                   # nothing was queued
    with pytest.raises(ValueError, match="KV blocks"):
        LLM(tiny_model("qwen2_moe"), block_size=4, num_kv_blocks=2).add_request([3, 4, 5], SamplingParams(max_tokens=8))


def test_set_plan_switches_the_decode_pool():
    model = tiny_model("qwen2_moe", seed=1)
    prompts = random_prompts([4, 13, 8], seed=1)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5)))
    llm = LLM(model)
    full = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.set_plan(plan)
    pruned = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.set_plan(None)
    again = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in full] == [o.token_ids for o in again] != [o.token_ids for o in pruned]


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_grouped_and_loop_experts_agree_with_sentinel_routes(arch):
    model = tiny_model(arch, seed=6)
    prompts = random_prompts([5, 12, 8], seed=6)
    drop = uniform_plan(model, decode=LayerPolicy(keep=(1, 3, 4, 6), pool_mode="drop"))  # drop -> sentinels
    budgets = [SamplingParams(max_tokens=8, ignore_eos=True, expert_top_k=k) for k in (1, None, 2)]
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    for plan, params in ((drop, plain), (None, budgets)):
        outs = {impl: LLM(model, plan, experts_impl=impl).generate(prompts, params) for impl in ("grouped", "loop")}
        assert [o.token_ids for o in outs["grouped"]] == [o.token_ids for o in outs["loop"]]


def test_dtype_names_are_accepted_and_a_bad_one_is_named():
    from moetailor.runtime.config import EngineConfig

    assert EngineConfig(dtype="bfloat16", decode_expert_dtype="torch.float32").dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype='fp33' is not a dtype.*float32"):
        EngineConfig(dtype="fp33")
    llm = LLM(tiny_model("qwen2_moe"), dtype="float32")
    assert llm.config.dtype is torch.float32


def test_engine_options_are_the_configs_fields_checked_once():
    """``LLM(model, plan, **options)``: options are ``EngineConfig``'s fields; a misspelt one is named
    with the valid ones, a bad value fails before the model loads."""
    with pytest.raises(TypeError, match=r"unknown engine option max_num_seq;.*max_num_seqs"):
        LLM("reference", max_num_seq=4)
    with pytest.raises(ValueError, match="block_size=0"):
        LLM("/a/checkpoint/that/does/not/exist", block_size=0)      # the config fails first, not the load
    llm = LLM(tiny_model("qwen2_moe"), max_num_seqs=3, block_size=4, device=torch.device("cpu"))
    assert (llm.config.max_num_seqs, llm.config.block_size, llm.config.device) == (3, 4, "cpu")
    assert llm.block_manager.block_size == 4
