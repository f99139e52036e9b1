"""A few hundred random and malformed requests against a running server (uvicorn on 127.0.0.1,
tiny model, a per-request plan and the guard on): random types per field, NaN/inf, huge and
subnormal numbers, broken JSON, wrong content types. No answer may be a 5xx, and the server must
be healthy, idle and serving afterwards. Seeded, so a failure reproduces."""
from __future__ import annotations

import json
import random

import httpx
import pytest
from engine_helpers import char_tokenizer, idle, start_server

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM
from moetailor.serving.server import ServerLimits, create_app

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "ignore_eos", "expert_top_k", "expert_plan", "n", "best_of", "presence_penalty",
          "frequency_penalty", "logit_bias", "suffix", "user", "stream_options", "response_format", "tools",
          "min_p", "logprobs", "echo"]
NUMBERS = [0, 1, -1, 2, 7, 16, 0.5, 1.0, 1e-320, 5e-324, 1e308, -1e308, 2**31, 2**63, 2**64, 2**70, -(2**63),
           float("nan"), float("inf"), float("-inf"), 1.5, 3.0, 1e-3]
N_REQUESTS = 300


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["none", "bool", "number", "number", "string", "list", "dict"] if depth < 3 else
                      ["none", "bool", "number", "string"])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "number":
        return rng.choice(NUMBERS)
    if kind == "string":
        return rng.choice(["", "hi", "default", "half", "full", "tiny", "user", "false", "\x00\ud7ff", "é" * 5,
                           "x" * rng.choice([1, 300, 5000])])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 5]))]
    return {rng.choice(FIELDS + ["role", "content", "type"]): random_value(rng, depth + 1)
            for _ in range(rng.choice([0, 1, 3]))}


def plausible(rng: random.Random, chat: bool) -> dict:
    """A mostly valid request with one to three fields replaced by random values."""
    body = {"model": "tiny", "max_tokens": rng.choice([1, 4, 12]), "temperature": rng.choice([0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant"]), "content": "hello"}]
    else:
        body["prompt"] = rng.choice(["hello", [5, 6, 7], ["one prompt"], "x" * 50])
    for field in ("seed", "stop", "stream", "ignore_eos", "expert_top_k", "expert_plan", "top_k", "top_p"):
        if rng.random() < 0.15:
            body[field] = {"seed": 3, "stop": ["\n"], "stream": True, "ignore_eos": True, "expert_top_k": 1,
                           "expert_plan": "half", "top_k": 5, "top_p": 0.9}[field]
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(FIELDS)] = random_value(rng)
    return body


def malformed(rng: random.Random) -> tuple[bytes, str]:
    """(body bytes, content type) that are not a usable JSON object."""
    choice = rng.randrange(10)
    if choice == 0:
        return b"", "application/json"
    if choice == 1:
        return b'{"prompt": "hi", "max_tokens": 4', "application/json"           # truncated
    if choice == 2:
        return b"\xff\xfe\x00garbage", "application/json"                       # not UTF-8
    if choice == 3:
        return b"[" * 5000 + b"]" * 5000, "application/json"                     # deeply nested
    if choice == 4:
        return b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json"   # 5000 digits
    if choice == 5:
        return json.dumps(random_value(rng)).encode(), "application/json"        # not an object
    if choice == 6:
        return b"prompt=hi&max_tokens=4", "application/x-www-form-urlencoded"
    if choice == 7:
        return json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), rng.choice(["text/plain", "", "image/png"])
    if choice == 8:
        return b'{"prompt": "hi", "prompt": 5, "max_tokens": NaN}', "application/json"   # duplicate keys, NaN
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), "application/octet-stream"


@pytest.fixture(scope="module")
def server(one_thread):
    model = tiny_model("qwen2_moe", vocab=128, seed=4)
    llm = LLM(model, tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=128, max_model_len=128)
    plans = {"half": uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))}
    app = create_app(llm, model_name="tiny", plans=plans, limits=ServerLimits(max_request_bytes=256 * 1024))
    base, _, stop = start_server(app)
    yield base, llm
    stop()


def test_random_and_malformed_requests_never_5xx(server):
    base, llm = server
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    failures = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(N_REQUESTS):
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            if rng.random() < 0.75:
                content = json.dumps(plausible(rng, chat=path.endswith("chat/completions"))).encode()
                ctype = "application/json"
            else:
                content, ctype = malformed(rng)
            r = client.post(path, content=content, headers={"content-type": ctype} if ctype else {})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                failures.append((i, content[:200], r.status_code, r.text[:300]))
    assert not failures, failures[:5]
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 100, statuses   # both paths were exercised
    assert idle(llm)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    assert httpx.get(base + "/health").json()["status"] == "ok"
    r = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
