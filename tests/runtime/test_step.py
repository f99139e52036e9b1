"""One engine step: the step object, the decode attention read in place, finishing in the
scheduler's postprocess (incremental detokenization), a bounded step log, and decode pools that
follow the load (tiny models and the bundled reference tokenizer)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts, stock_twin

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.routing.traffic import StepCost
from moetailor.runtime.step import current, read_experts
from moetailor.serving import LLM, SamplingParams
from moetailor.serving.load_pools import PoolRung, PoolsByLoad


def test_implementations_are_installed_once_and_the_step_is_cleared():
    import dataclasses

    model = tiny_model("qwen2_moe", seed=4)
    reference = stock_twin(model)
    llm = LLM(model, block_size=4)
    impl = (model.config._attn_implementation, model.config._experts_implementation)
    seen = []
    llm.controller.observers.append(lambda layer, *a: seen.append(current()))
    llm.generate(random_prompts([5, 9], seed=4), SamplingParams(max_tokens=4, ignore_eos=True))
    assert (model.config._attn_implementation, model.config._experts_implementation) == impl
    assert seen and all(c is not None for c in seen)          # the router read the step
    assert {c.is_prefill for c in seen} == {True, False}
    with pytest.raises(dataclasses.FrozenInstanceError):      # which nobody can change once built
        seen[0].is_prefill = False
    assert current() is None                                  # and nothing is left behind
    assert not any(k.startswith("_moetailor_meter") for l in llm.controller.layers for k in vars(l.experts))
    prompt = random_prompts([7], seed=5)[0]                   # a second engine on the same object: still stock
    assert LLM(model, block_size=4).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0] \
        .token_ids == hf_greedy(reference, prompt, 6)


@pytest.mark.parametrize("lengths", [[9], [6, 6, 6], [3, 11, 6]])
def test_decode_attention_reads_the_cache_in_place(lengths):
    """A lone sequence with contiguous blocks (a view), equal lengths (no mask), mixed lengths (mask),
    and a fragmented pool (blocks handed out out of order): all equal transformers."""
    model = tiny_model("qwen3_moe", seed=7)
    reference = stock_twin(model)
    prompts = random_prompts(lengths, seed=7)
    llm = LLM(model, block_size=4, num_kv_blocks=64)
    llm.block_manager.free_blocks.rotate(5)                   # block tables start mid-pool, wrap around
    outs = llm.generate(prompts, SamplingParams(max_tokens=7, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 7) for p in prompts]


def test_step_log_is_bounded():
    llm = LLM(tiny_model("qwen2_moe"), step_log_size=5)
    llm.generate(random_prompts([4]), SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(llm.step_log) == 5 and all(r.phase == "decode" for r in llm.step_log)
    assert llm.stats()["decode_tokens_per_s"] > 0


def test_incremental_text_equals_a_full_decode_with_multibyte_text():
    from moetailor.models.loading import load_tokenizer

    tok = load_tokenizer("reference")
    text = "naïve café — 東京 ✓ plain words, and é at the end é"
    ids = tok.encode(text, add_special_tokens=False)
    llm = LLM(tiny_model("qwen2_moe", vocab=len(tok)), tokenizer=tok)
    seq = llm.add_request([ids[0]], SamplingParams(max_tokens=len(ids)))
    pieces = []
    for token in ids[1:]:                                     # feed the text's own tokens as "sampled"
        before = seq.text
        llm.scheduler.postprocess([seq], [token])
        assert seq.text.startswith(before) or seq.is_finished
        pieces.append(seq.text[len(before):])
    assert seq.text == tok.decode(ids[1:], skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)


def test_text_is_decoded_when_read_not_at_every_step(tokenizer):
    """A request without stop strings is decoded once, at its end; a stream reads its text each step
    and gets the same text; an aborted request's text covers every token it got."""
    llm = LLM(tiny_model("qwen2_moe", vocab=128), tokenizer=tokenizer)
    calls = []
    decode = llm.scheduler.detokenizer._decode
    llm.scheduler.detokenizer._decode = lambda ids: calls.append(len(ids)) or decode(ids)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = llm.generate(["abc def"], params)[0]
    assert calls == [12] and out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    streamed = "".join(d.text for d in llm.stream("abc def", params))
    assert streamed == out.text and len(calls) > 12                # a stream decodes a window each step
    seq = llm.add_request("abc def", params)
    for _ in range(5):
        llm.step()
    llm.abort(seq.request_id)
    assert seq.text == tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) and seq.text


def test_stop_string_spanning_tokens_cuts_the_text(tokenizer):
    llm = LLM(tiny_model("qwen2_moe", vocab=128), tokenizer=tokenizer)
    greedy = llm.generate(["abc def"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = greedy.text[4:7]
    out = llm.generate(["abc def"], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == greedy.text[:greedy.text.find(stop)]
    assert len(out.token_ids) < len(greedy.token_ids)


def test_pools_by_load_thresholds_follow_the_cost_model():
    model = tiny_model("qwen2_moe", seed=1, num_experts=8, top_k=2)
    half = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5, 7)))
    cost = StepCost(num_layers=2, num_experts=8, per_expert=1e-3, per_token=1e-4, fixed=1e-3)
    slo = cost.seconds(2, 3) + 1e-6                         # the full pool meets it up to batch 3
    pools = PoolsByLoad.from_slo([None, half], cost, slo, top_k=2, max_batch=16)
    assert [(r.pool_size, r.min_batch) for r in pools.rungs] == [(8, 1), (4, 4)]
    assert [pools.rung_for(b).plan for b in (1, 3, 16)] == [None, None, half]
    with pytest.raises(ValueError, match="threshold of 1"):
        PoolsByLoad([PoolRung(half, 4, 2)])


def test_decode_pools_by_load_switch_per_step_on_one_kv_cache():
    model = tiny_model("qwen2_moe", seed=1)
    keep = (0, 2, 5)
    half = uniform_plan(model, decode=LayerPolicy(keep=keep))
    prompts = random_prompts([4, 13, 8], seed=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(model, block_size=4)
    llm.set_decode_pools(PoolsByLoad([PoolRung(None, 8, 1), PoolRung(half, len(keep), 2)]))
    batched = llm.generate(prompts, params)                   # batch 3: the small pool
    alone = llm.generate(prompts[:1], params)[0]              # batch 1: the full pool
    assert alone.token_ids == LLM(model, block_size=4).generate(prompts[:1], params)[0].token_ids
    assert [o.token_ids for o in batched] == [o.token_ids for o in LLM(model, half, block_size=4).generate(prompts, params)]
    decode = [r for r in llm.step_log if r.phase == "decode"]
    assert {r.pool_size for r in decode} == {len(keep), 8}
    assert all(max(r.distinct_experts.values()) <= len(keep) for r in decode if r.pool_size == len(keep))


@pytest.mark.parametrize("pack", [False, True])
def test_bf16_decode_experts_read_half_the_bytes_and_prefill_keeps_fp32(pack):
    """pack: the engine takes the model over and packs its experts (the decode copies too)."""
    model = tiny_model("qwen2_moe", seed=2)
    prompts = random_prompts([6, 10], seed=2)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    fp32 = LLM(model, block_size=4)
    half = LLM(model, block_size=4, decode_expert_dtype=torch.bfloat16, pack_weights=pack)
    a, b = fp32.generate(prompts, params), half.generate(prompts, params)
    assert [o.token_ids[0] for o in a] == [o.token_ids[0] for o in b]     # the prefill token: model weights
    for phase, ratio in (("prefill", 1.0), ("decode", 0.5)):
        per = [[r.expert_bytes / sum(r.distinct_experts.values()) for r in llm.step_log if r.phase == phase]
               for llm in (fp32, half)]
        assert per[1][0] == per[0][0] * ratio
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    from moetailor import kernels
    held = half.runner.expert_weights[False]
    assert all(kernels.is_packed(w) == (pack and half.runner.native_experts is not None) and w.dtype == torch.bfloat16
               for pair in held.values() for w in pair)


def test_grouped_experts_never_read_the_device_and_drop_sentinels(monkeypatch):
    from moetailor.models.adapters import moe_layers
    from moetailor.routing.controller import RoutingController
    from moetailor.runtime.experts import grouped_experts_forward, loop_experts_forward
    from moetailor.runtime.step import Step, experts_read_buffer, read_experts, running

    model = tiny_model("qwen2_moe", seed=3)
    RoutingController.of(model)                                                          # names each layer
    experts = moe_layers(model)[0].experts
    E = experts.num_experts
    hidden = torch.randn(5, model.config.hidden_size)                                  # [T, H]
    index = torch.tensor([[0, 3], [E, 1], [3, E], [E, E], [2, 0]])                       # [T, K], E = dropped
    weights = torch.rand(5, 2).masked_fill(index == E, 0.0)
    expected = loop_experts_forward(experts, hidden, index, weights)

    def host_read(*args, **kwargs):
        raise AssertionError("the grouped experts read a device value on the host")
    step = Step(is_prefill=False, experts="grouped", experts_read=experts_read_buffer(2))
    with running(step), monkeypatch.context() as m, torch.inference_mode():
        for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
            m.setattr(torch.Tensor, name, host_read)
        out = grouped_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(out, expected)
    assert read_experts(step) == {0: 4}                                                 # experts 0, 1, 2, 3


def test_cli_pools_by_load_need_a_step_slo(capsys):
    from pathlib import Path

    from moetailor.cli.main import main

    plan = Path(__file__).resolve().parents[2] / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"
    code = main(["generate", "reference", "--prompt", "hi", "--max-tokens", "2", "--decode-pools-by-load", str(plan)])
    err = capsys.readouterr().err
    assert code == 2 and "--step-slo-ms" in err and "Traceback" not in err
    assert main(["generate", "reference", "--prompt", "hi", "--max-tokens", "4", "--ignore-eos",
                 "--decode-pools-by-load", str(plan), "--step-slo-ms", "5"]) == 0
    captured = capsys.readouterr()
    assert "decode steps per pool (experts per layer)" in captured.out          # which pool the steps ran
    assert "moetailor generate: peak RSS" in captured.err
    code = main(["generate", "reference", "--prompt", "hi", "--step-slo-ms", "5"])   # no pools: not ignored
    err = capsys.readouterr().err
    assert code == 2 and "--decode-pools-by-load" in err and len(err.strip().splitlines()) == 1


def test_calibration_and_evaluation_route_through_the_same_step_object():
    """``RoutingController.policy`` runs its forwards inside a routing-only ``Step`` (the engine's
    type): the routers read its compiled policy, the experts report what they read into it."""
    from moetailor.routing import RoutingController

    model = tiny_model("qwen2_moe", seed=6, num_experts=8, top_k=2)
    ctl = RoutingController.of(model)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))
    with torch.no_grad(), ctl.policy(plan.decode) as step:
        assert current() is step and step.kv is None and step.routing.policy is ctl.compile(plan.decode)
        model(torch.tensor([random_prompts([9], seed=6)[0]]))
    distinct = read_experts(step)
    assert set(distinct) == {l.index for l in ctl.layers} and max(distinct.values()) <= 4
    assert current() is None
