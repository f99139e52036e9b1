"""The OpenAI-compatible server on a tiny model: the official `openai` client (streaming and not),
400s for bad input, metrics, per-request expert plans, and blocks freed on client disconnect."""
from __future__ import annotations

import time

import httpx
import pytest
from engine_helpers import char_tokenizer, start_server

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams
from moetailor.serving.server import create_app

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def server():
    model = tiny_model("qwen2_moe", vocab=128, seed=4)
    llm = LLM(model, tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=NUM_BLOCKS, max_model_len=128)
    plans = {"half": uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))}
    base, _, stop = start_server(create_app(llm, model_name="tiny", plans=plans))
    yield base, llm
    stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def test_openai_client_completions_equal_engine_output(server, client):
    _, llm = server
    resp = client.completions.create(model="tiny", prompt="hello wor", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8
    with llm.lock:
        ids = llm.encode("hello wor")[1]
    ref = LLM(llm.model, tokenizer=llm.tokenizer, block_size=4).generate(
        [ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert resp.choices[0].text == ref.text


def test_openai_client_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "abc"}], **kw)
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "abc"}], stream=True, **kw)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    text_stream = client.completions.create(prompt="xyz", stream=True, **kw)
    assert len([c for c in text_stream]) >= 2


def test_expert_plan_field(server, client):
    kw = dict(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0)
    full = client.completions.create(extra_body={"expert_plan": "full", "ignore_eos": True}, **kw)
    half = client.completions.create(extra_body={"expert_plan": "half", "ignore_eos": True}, **kw)
    default = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert full.choices[0].text == default.choices[0].text
    assert half.choices[0].text != full.choices[0].text
    models = httpx.get(server[0] + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and "half" in models["data"][0]["expert_plans"]


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x" * 200, "max_tokens": 4}, "context limit of 128"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "expert_plan": "nope"}, "unknown expert_plan 'nope'"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
])
def test_bad_input_is_400_with_the_reason(server, body, needle):
    r = httpx.post(server[0] + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_chat_messages_are_400(server):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_metrics_and_health(server, client):
    client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("moetailor_requests_waiting", "moetailor_requests_running", "moetailor_kv_cache_usage",
                 "moetailor_decode_tokens_per_second", "moetailor_step_distinct_experts{layer=\"0\""):
        assert name in text
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_client_disconnect_mid_stream_frees_blocks(server):
    base, llm = server
    with httpx.stream("POST", base + "/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 100,
                                                             "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert llm.block_manager.num_free < NUM_BLOCKS
    for _ in range(100):   # the server notices the closed connection on its next write
        if llm.block_manager.num_free == NUM_BLOCKS and not llm.has_unfinished():
            break
        time.sleep(0.05)
    assert llm.block_manager.num_free == NUM_BLOCKS and not llm.has_unfinished()
