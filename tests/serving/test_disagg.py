"""Disaggregated prefill/decode in two processes: output equals colocated token for token (pruned
checkpoint and masked model), freed weights become KV blocks, decode-worker death is survived."""
from __future__ import annotations

import pytest
from engine_helpers import random_prompts

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams
from moetailor.serving.disagg import DisaggregatedLLM
from moetailor.transforms.prune import prune_checkpoint

KEEP = (0, 2, 5, 7, 9, 11)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg")
    model = tiny_model("qwen2_moe", seed=5, num_experts=16, expert_width=64)
    model.save_pretrained(root / "full")
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    plan.save(root / "plan.json")
    prune_checkpoint(model, plan, root / "pruned")
    return root, model, plan


def colocated(model, plan, prompts, params):
    return LLM(model, plan, block_size=4).generate(prompts, params)


def test_disaggregated_equals_colocated_and_frees_kv_capacity(checkpoints):
    root, model, plan = checkpoints
    prompts = random_prompts([5, 14, 9, 3], seed=5)
    params = [SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=1, ignore_eos=True)]
    ref = colocated(model, plan, prompts, params)
    budget = 2 * 2**20
    with DisaggregatedLLM(str(root / "full"), decode_model=str(root / "pruned"), block_size=4,
                          memory_budget=budget) as dis:
        outs = dis.generate(prompts, params)
        cap = dis.capacity()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.token_ids for o in ref] != [o.token_ids for o in colocated(model, None, prompts, params)], \
        "the pruned decode pool should change some output"
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert cap["decode_weight_bytes"] < cap["prefill_weight_bytes"]
    assert cap["decode_blocks"] > cap["decode_blocks_with_full_weights"] == cap["prefill_blocks"]


def test_disaggregated_masked_decode_equals_colocated(checkpoints):
    root, model, plan = checkpoints
    prompts = random_prompts([6, 11], seed=6)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with DisaggregatedLLM(str(root / "full"), plan=plan, block_size=4) as dis:
        with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
            dis.generate(prompts, [params])            # named before anything reaches the workers
        outs = dis.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated(model, plan, prompts, params)]
    assert [o.token_ids for o in outs] != [o.token_ids for o in colocated(model, None, prompts, params)]


def test_decode_worker_death_ends_requests_with_error_and_serving_continues(checkpoints):
    root, model, plan = checkpoints
    prompt = random_prompts([6], seed=7)[0]
    with DisaggregatedLLM(str(root / "full"), decode_model=str(root / "pruned"), block_size=4) as dis:
        seq = dis.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        while seq.stage != "decode" or len(seq.completion_token_ids) < 3:
            dis.step()
        dis.workers["decode"].process.kill()    # as the OS would
        while not seq.is_finished:
            dis.step()
        assert seq.finish_reason == "error" and "decode worker exited" in seq.error
        assert dis.restarts["decode"] == 1
        again = dis.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert again.finish_reason == "length"
    assert again.token_ids == colocated(model, plan, [prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("room", [True, False])
def test_an_adopted_sequence_continues_as_if_colocated(checkpoints, room):
    """The decode side's half of a hand-over, in one process: a sequence prefilled by one engine
    joins another engine's decode batch with its KV blocks written in unchanged (``room``: it
    continues exactly as the colocated engine does; greedy, so a wrong cache changes the tokens),
    or, when that engine has no free slot, waits and is prefilled again there (as a preempted
    sequence is: prompt and first token in one prefill)."""
    from moetailor.serving.disagg import adopted

    _, model, plan = checkpoints
    prompt = random_prompts([11], seed=6)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = colocated(model, plan, [prompt], params)[0]
    prefill = LLM(model, block_size=4)
    first = prefill.add_request(prompt, params, request_id="r")
    prefill.step()                                                      # prefill + the first token
    kv = prefill.runner.read_blocks(first.block_table)
    decode = LLM(model, plan, block_size=4, max_num_seqs=1)
    busy = None if room else decode.add_request(random_prompts([5], seed=7)[0], SamplingParams(max_tokens=3))
    if busy is not None:
        decode.step()                                                   # the only slot is taken
    seq = adopted(first.token_ids, first.num_prompt_tokens, params, "r")
    assert decode.enqueue(seq, kv) and not decode.enqueue(seq, kv)      # a request id is used once
    assert (seq in decode.scheduler.running) == room
    while not seq.is_finished:
        decode.step()
    again = colocated(model, plan, [first.token_ids], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert seq.completion_token_ids == (ref.token_ids if room else first.completion_token_ids + again[0].token_ids)
    assert seq.num_preemptions == 0 and (busy is None or busy.is_finished)



def test_generate_prints_the_decode_workers_speed_and_experts(tmp_path, capsys):
    """`generate --decode-model` reports decode tokens/s and distinct experts from the decode worker's
    own steps (they arrive with its stats reports), not "-"."""
    from moetailor.cli.main import main

    plan = "src/moetailor/assets/plans/reference-reap-50.json"
    assert main(["prune", "reference", plan, "--out", str(tmp_path / "pruned")]) == 0
    capsys.readouterr()
    assert main(["generate", "reference", "--decode-model", str(tmp_path / "pruned"), "--prompt", "add 12 + 34\n",
                 "--max-tokens", "6", "--ignore-eos", "--threads", "1"]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in capsys.readouterr().out.splitlines()
            if line.count("│") == 3}
    assert float(rows["decode tokens/s"]) > 0
    assert 0 < float(rows["distinct experts per layer per decode step (mean)"]) <= 32
