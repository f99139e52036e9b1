"""The collapse guard (serving/guard.py) on tiny models: a constructed decoder that never emits EOS
trips it and requests then finish on the full pool, a healthy plan does not trip it, the switch
reuses the KV cache, and a tripped policy is re-enabled after a cool-down on fresh evidence."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from engine_helpers import random_prompts

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy, RoutingController
from moetailor.serving import LLM, SamplingParams
from moetailor.serving.guard import GuardConfig, repetition, window_stats
from moetailor.serving.server import guard_metrics

EOS = 0
GATE = (4, 5, 6, 7)          # EOS can only win on a token routed through one of these experts
DEGENERATE = (0, 1, 2, 3)    # a decode pool without them never emits EOS
HEALTHY = (0, 1, 2, 4, 5, 6, 7)


@contextmanager
def eos_needs_experts(model, experts=GATE):
    """Make the tiny model's EOS depend on its routing: on a token whose routing used one of
    ``experts`` in some MoE layer, EOS wins when the best other token id is even; on
    any other token EOS never wins. The full pool ends after a few tokens; a pool without those
    experts never ends (SlimWise's silent collapse, built on purpose)."""
    ctl = RoutingController.of(model)
    gate = torch.tensor(experts)
    state: dict = {}

    def before(module, args, kwargs):
        state["hit"], state["keep"] = None, kwargs.get("logits_to_keep", 0)

    def observe(layer, hidden, logits, weights, index):                 # index [T, K]
        hit = (torch.isin(index, gate) & (weights > 0)).any(-1)           # [T]
        state["hit"] = hit if state["hit"] is None else state["hit"] | hit

    def after(module, args, out):                                         # out [1, B, V]
        hit, keep = state["hit"], state["keep"]
        hit = hit[keep] if torch.is_tensor(keep) else (hit[-keep:] if keep else hit)   # [B]
        best_other = out[..., 1:].argmax(-1) + 1                          # [1, B]
        wins = hit[None] & (best_other % 2 == 0)
        out = out.clone()
        out[..., EOS] = torch.where(wins, out.max(-1).values + 1.0, torch.full_like(out[..., EOS], float("-inf")))
        return out

    h1 = model.register_forward_pre_hook(before, with_kwargs=True)
    h2 = model.get_output_embeddings().register_forward_hook(after)
    try:
        with ctl.observing(observe):
            yield
    finally:
        h1.remove(), h2.remove()


def with_and_without_guard(model, plan, prompts, params, experts=GATE):
    """``prompts`` served on ``plan`` without the guard, with it (1 in 4 shadowed) and on the full pool,
    while EOS needs ``experts``: (unguarded outputs, guarded engine, its outputs, full-pool outputs)."""
    with eos_needs_experts(model, experts):
        off = LLM(model, plan, block_size=4, max_num_seqs=8).generate(prompts, params)
        llm = LLM(model, plan, block_size=4, max_num_seqs=8, guard=GuardConfig(shadow_fraction=0.25))
        on = llm.generate(prompts, params)
        full = LLM(model, block_size=4, max_num_seqs=8).generate(prompts, params)
    return off, llm, on, full


def length_hits(outputs) -> int:
    return sum(o.finish_reason == "length" for o in outputs)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_moe", seed=5)


def decode_plan(model, keep):
    return uniform_plan(model, decode=LayerPolicy(keep=keep))


def test_repetition_measure():
    assert repetition([1, 2, 3, 4, 5, 6, 7, 8], 2) == 0.0
    assert repetition([1, 2] * 10, 2) > 0.8
    with pytest.raises(ValueError, match="shadow_fraction"):
        GuardConfig(shadow_fraction=2.0)
    assert GuardConfig.parse("shadow_fraction=0.5,entropy_factor=none,window=32") == \
        GuardConfig(shadow_fraction=0.5, entropy_factor=None, window=32)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        GuardConfig.parse("nonsense=1")


def test_degenerate_decoder_trips_guard_and_requests_finish_on_full_pool(model):
    prompts = random_prompts([5 + i % 7 for i in range(32)], seed=5)
    params = SamplingParams(max_tokens=48)
    plan = decode_plan(model, DEGENERATE)
    off, llm, on, full = with_and_without_guard(model, plan, prompts, params)
    hits_off, hits_on = length_hits(off), length_hits(on)
    assert length_hits(full) <= 2   # the full pool ends (almost) every request
    assert hits_off >= 16                                         # the reduced pool collapses without the guard
    snap = llm.guard.snapshot()["policies"]["default"]
    assert snap["state"] == "tripped" and snap["trips"] == 1, snap
    assert hits_on <= hits_off // 2, (hits_on, hits_off)
    assert snap["decode_steps"]["fallback"] > 0 and 0 < snap["fallback_step_share"] < 1
    # the trip came early; every request admitted after it ran whole on the full pool: the full engine's tokens
    assert next(e for e in llm.guard.events if e["event"] == "trip")["step"] < 100
    assert [o.token_ids for o in on[16:]] == [o.token_ids for o in full[16:]]
    text = "\n".join(guard_metrics(llm.guard.snapshot()))
    assert 'moetailor_guard_policy_state{policy="default"} 2' in text
    assert 'pool="fallback"' in text


def test_healthy_plan_does_not_trip(model):
    prompts = random_prompts([4 + i % 9 for i in range(48)], seed=6)
    llm = LLM(model, decode_plan(model, HEALTHY), block_size=4, max_num_seqs=8,
              guard=GuardConfig(shadow_fraction=0.25))
    with eos_needs_experts(model):
        outs = llm.generate(prompts, SamplingParams(max_tokens=48))
        while llm.has_unfinished():   # let the last shadows finish
            llm.step()
    snap = llm.guard.snapshot()
    p = snap["policies"]["default"]
    assert snap["reference"]["requests"] >= 8                    # the comparison did happen
    assert p["state"] == "active" and p["trips"] == 0 and not p["rescued"], p
    assert p["decode_steps"]["fallback"] == 0 and p["decode_steps"]["reduced"] > 0
    assert sum(o.finish_reason == "stop" for o in outs) == len(outs)


def handover(model, prompt, plan, switch_at: int, n: int) -> list[int]:
    """Reference: full prefill, reduced decode until token ``switch_at``, then the full pool, all on
    one transformers cache (the tokens decoded on the reduced pool keep their KV)."""
    ctl = RoutingController.of(model)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache, tokens = out.cache, [int(out.logits[0, -1].argmax())]
        while len(tokens) < n and tokens[-1] != EOS:
            with ctl.policy(plan.decode if len(tokens) < switch_at else None):
                out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_switch_keeps_the_kv_cache(model):
    """Requests moved mid-decode continue from their cache: no prefill is repeated and the tokens
    equal a cache hand-over reference that switches pools at the same token."""
    plan = decode_plan(model, DEGENERATE)
    llm = LLM(model, plan, block_size=4, max_num_seqs=16, num_kv_blocks=512,
              guard=GuardConfig(shadow_fraction=0.0, warmup_shadows=0, min_reference=4, length_slack=4))
    params = SamplingParams(max_tokens=40)
    reference = random_prompts([6, 7, 8, 9, 10, 11], seed=7)
    prompts = random_prompts([5, 9, 12, 6, 8, 10, 7, 11], seed=8)
    with eos_needs_experts(model):
        for p in reference:           # full-pool requests give the guard its comparison window
            llm.add_request(p, params, plan=uniform_plan(model), plan_key="full")
        while llm.has_unfinished():
            llm.step()
        outs = llm.generate(prompts, params)
        rescues = {e["request_id"]: e["at_token"] for e in llm.guard.events if e["event"] == "rescue"}
        assert rescues, "the reduced decoder should have been caught mid-request"
        for prompt, out in zip(prompts, outs):
            if out.request_id in rescues:
                assert out.finish_reason == "stop"
                assert out.token_ids == handover(model, prompt, plan, rescues[out.request_id], 40)
    prefill_tokens = sum(r.num_tokens for r in llm.step_log if r.phase == "prefill")
    assert llm.scheduler.num_preemptions == 0
    assert prefill_tokens == sum(map(len, reference)) + sum(map(len, prompts))   # nothing recomputed


def test_cooldown_probation_and_reenable(model):
    plan = decode_plan(model, DEGENERATE)
    cfg = GuardConfig(shadow_fraction=0.5, window=8, min_requests=4, min_reference=2, cooldown_steps=60,
                      probe_requests=4)
    llm = LLM(model, plan, block_size=4, max_num_seqs=8, guard=cfg)
    params = SamplingParams(max_tokens=32)
    with eos_needs_experts(model):
        llm.generate(random_prompts([6] * 16, seed=9), params)
    assert llm.guard.policies["default"].state == "tripped"
    # the collapse was transient (the EOS gate is gone): after the cool-down, probes pass and the plan returns
    for _ in range(40):
        llm.add_request(random_prompts([5], seed=10)[0], SamplingParams(max_tokens=4))
        while llm.has_unfinished():
            llm.step()
    events = [e["event"] for e in llm.guard.events]
    assert "probation" in events and events[-1] == "re-enabled", events
    assert llm.guard.policies["default"].state == "active"
    assert window_stats(llm.guard.policies["default"].window)["requests"] >= cfg.probe_requests


def test_server_turns_the_guard_on_and_exposes_it(model):
    from moetailor.serving.server import create_app, prometheus_text

    llm = LLM(model, decode_plan(model, HEALTHY), block_size=4)
    app = create_app(llm, model_name="tiny")
    try:
        assert llm.guard is not None and llm.guard.enabled
        llm.generate(random_prompts([6], seed=11), SamplingParams(max_tokens=4))
        text = prometheus_text(llm)
        assert 'moetailor_guard_policy_state{policy="default"} 0' in text
        assert 'moetailor_guard_decode_steps_total{policy="default",pool="reduced"}' in text
    finally:
        app.state.engine.close()


def test_guarded_eval_configuration(model):
    from moetailor.eval.configurations import parse_configs

    spec = parse_configs("guarded:phase-aware")[0]
    served = spec.build(model, decode_plan(model, DEGENERATE))
    plan = served.plan
    assert served.guard is True and plan.meta["configuration"] == "guarded:phase-aware"
    assert plan.prefill.is_identity and not plan.decode.is_identity
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_configs("guarded:nope")[0].build(model, decode_plan(model, DEGENERATE))


def test_the_guard_decides_and_never_calls_the_engine():
    """Without an engine at all: admission gives the reduced request a full-pool shadow (warm-up),
    a repeating reduced decoder gets a RunOn to the full pool, and forgetting the request aborts its
    shadow; applying those decisions is the engine's job."""
    from moetailor.serving.guard import FULL_KEY, Abort, Guard, RunOn, shadow_id
    from moetailor.serving.scheduler import Sequence

    model = tiny_model("qwen2_moe", seed=0)
    full, reduced = uniform_plan(model), uniform_plan(model, decode=LayerPolicy(keep=HEALTHY))
    guard = Guard(full, GuardConfig(repetition_min_tokens=8, check_every=1))
    seq = Sequence([5, 6, 7], SamplingParams(max_tokens=64))
    admission = guard.admit(seq, reduced)
    assert admission.plan is None and admission.shadow is not None            # runs on its plan, shadowed
    assert admission.shadow.plan is full and admission.shadow.plan_key == FULL_KEY
    assert admission.shadow.request_id == shadow_id(seq.request_id)
    logits = torch.zeros(1, 16)
    actions = []
    for _ in range(12):                                                      # the same token again and again
        seq.append_token(3)
        actions += guard.observe([seq], logits, is_prefill=False)
    assert [type(a) for a in actions] == [RunOn] and actions[0].seq is seq and actions[0].plan is full
    assert seq.plan is None                                                  # the guard changed nothing itself
    assert guard.forget(seq) == [Abort(shadow_id(seq.request_id))]
