"""Third reliability round (docs/reliability.md, issue 30): stop strings that span tokens, the API
key, the collapse guard on ordinary traffic, malformed text and token ids, OpenAI message forms,
stream usage, size limits and the small HTTP details. A real uvicorn server on 127.0.0.1 over the
bundled ``reference`` model (a tiny Qwen2-MoE with a real tokenizer) unless a test says otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moetailor.engine import LLM, SamplingParams
from moetailor.engine.server import create_app

from engine_helpers import start_server

ROOT = Path(__file__).resolve().parents[2]
REAP_50 = ROOT / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"


@pytest.fixture(scope="module")
def reference(one_thread):
    return LLM("reference", max_model_len=512)


@pytest.fixture(scope="module")
def server(reference):
    base, port, stop = start_server(create_app(reference, model_name="reference"))
    yield base, port, reference
    stop()


def post(base, body, path="/v1/completions", **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(base + path, content=data, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=120, **kw)


def stream_texts(base, body, path="/v1/completions") -> list[str]:
    """The text of each streamed event (completions), in order."""
    r = post(base, {**body, "stream": True}, path)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    key = (lambda c: c["delta"].get("content") or "") if "chat" in path else (lambda c: c["text"])
    return [key(e["choices"][0]) for e in events if e.get("choices")]


# ---- 1. stop strings that span tokens ---------------------------------------------------------------
@pytest.mark.parametrize("prompt, stop", [("The quick brown fox", "-0"), ("Q: what is 2+2?", "\n\n")])
def test_a_stop_string_spanning_tokens_never_reaches_the_client(server, prompt, stop):
    base, _, llm = server
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0}
    full = post(base, body).json()["choices"][0]["text"]
    assert stop in full   # and spans two tokens ("-", "0" and "\n", "\n")
    want = full[:full.index(stop)]
    r = post(base, {**body, "stop": [stop]}).json()["choices"][0]
    assert r["text"] == want and r["finish_reason"] == "stop"
    pieces = stream_texts(base, {**body, "stop": [stop]})
    assert "".join(pieces) == want
    # what the engine itself returns agrees (moetailor generate was right already)
    assert llm.generate(prompt, SamplingParams(max_tokens=20, stop=[stop]))[0].text == want


def test_a_stream_never_emits_text_that_becomes_part_of_a_stop_string(server):
    """With a stop string that never completes, the held-back characters are still delivered."""
    base, _, _ = server
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    full = post(base, body).json()["choices"][0]["text"]
    pieces = stream_texts(base, {**body, "stop": ["-0Z"]})     # "-0" happens, "-0Z" never does
    assert "".join(pieces) == full
    sent = ""
    for piece in pieces[:-1]:
        sent += piece
        assert not any(sent.endswith("-0Z"[:n]) for n in (1, 2)) or sent == full, sent


def test_stop_prefix_hold_back():
    from moetailor.engine.sequence import stop_prefix_len

    assert stop_prefix_len("abc-", ("-0",)) == 1
    assert stop_prefix_len("abc-0", ("-0",)) == 0          # complete: the engine finishes on it
    assert stop_prefix_len("ab\n", ("\n\n", "b\nx")) == 2
    assert stop_prefix_len("abc", ()) == 0


# ---- 2. an empty API key ------------------------------------------------------------------------------
def test_an_empty_api_key_is_refused(one_thread, reference):
    from moetailor.cli.serve import resolve_api_key

    for flag, env in (("", "envkey"), ("", None), ("  ", None), (None, ""), (None, " ")):
        with pytest.raises(ValueError, match="empty"):
            resolve_api_key(flag, env)
    assert resolve_api_key(None, "envkey") == "envkey" and resolve_api_key("k", "envkey") == "k"
    assert resolve_api_key(None, None) is None
    with pytest.raises(ValueError, match="empty"):
        create_app(reference, model_name="reference", api_key="")


def test_serve_with_an_empty_api_key_exits_in_one_line_before_loading():
    env = {**os.environ, "MOETAILOR_API_KEY": "envkey", "PYTHONPATH": str(ROOT / "src")}
    for extra in (["--api-key", ""], ["--port", "70000"]):
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", *extra],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert ("empty" if "--api-key" in extra else "--port 70000") in r.stderr


def test_bearer_scheme_is_case_insensitive(one_thread, reference):
    base, _, stop = start_server(create_app(reference, model_name="reference", api_key="sekrit"))
    try:
        assert httpx.get(base + "/v1/models").status_code == 401
        for header in ("Bearer sekrit", "bearer sekrit", "BEARER  sekrit"):
            assert httpx.get(base + "/v1/models", headers={"authorization": header}).status_code == 200, header
        for header in ("Basic sekrit", "sekrit", "Bearer", "Bearer sekri", "bearer sekrit2"):
            assert httpx.get(base + "/v1/models", headers={"authorization": header}).status_code == 401, header
    finally:
        stop()


# ---- 3. the collapse guard on ordinary traffic --------------------------------------------------------
def test_short_max_tokens_traffic_does_not_trip_the_guard(one_thread):
    """Two 80-token requests, then 30 with max_tokens 1, under the bundled REAP-50 decode plan: the
    guard stays active and the same greedy request returns the same text."""
    from moetailor.plans.plan import Plan

    llm = LLM("reference", Plan.load(REAP_50).phase_aware(), max_model_len=512)   # serve --decode-plan
    base, _, stop = start_server(create_app(llm, model_name="reference"))
    try:
        long = {"prompt": "The quick brown fox", "max_tokens": 80, "temperature": 0}
        first = post(base, long).json()["choices"][0]["text"]
        post(base, {**long, "prompt": "Once upon a time"})
        for i in range(30):
            assert post(base, {"prompt": f"item {i}:", "max_tokens": 1, "temperature": 0}).status_code == 200
        snap = llm.guard.snapshot()["policies"]["default"]
        assert snap["state"] == "active" and snap["trips"] == 0, (snap, llm.guard.events)
        assert post(base, long).json()["choices"][0]["text"] == first
    finally:
        stop()
