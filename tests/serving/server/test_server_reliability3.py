"""Third reliability round (docs/reliability.md): stop strings that span tokens, the API
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
from engine_helpers import start_server

from moetailor.serving import LLM, SamplingParams
from moetailor.serving.server import create_app

ROOT = Path(__file__).resolve().parents[3]
REAP_50 = ROOT / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"


@pytest.fixture(scope="module")
def reference(one_thread):
    return LLM("reference", max_model_len=512)


@pytest.fixture
def fresh(one_thread):
    """An engine of its own, for a test that starts a server with other settings (two servers must
    never drive one engine)."""
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
    from moetailor.serving.outputs import stop_prefix_len

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
        r = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", *extra],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert ("empty" if "--api-key" in extra else "--port 70000") in r.stderr


def test_bearer_scheme_is_case_insensitive(fresh):
    base, _, stop = start_server(create_app(fresh, model_name="reference", api_key="sekrit"))
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


# ---- 4. idle and half-header connections -------------------------------------------------------------
def start_bounded(app, limits):
    """uvicorn with the server's own connection bounds (``server_config``, what ``serve`` runs)."""
    return start_server(app, limits)


def closed_by_server(sock, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (recv returns b"")."""
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_half_header_connections_are_closed_and_excess_ones_shed(fresh, caplog):
    import socket

    from moetailor.serving.server import ServerLimits

    limits = ServerLimits(idle_timeout_s=1.0, header_timeout_s=2.0, max_connections=40)
    base, port, stop = start_bounded(create_app(fresh, model_name="reference"), limits)
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        half = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        for s in half:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")      # never finishes the head
        started = time.monotonic()
        assert all(closed_by_server(s, 6) for s in idle + half)
        assert time.monotonic() - started < 6
        # a keep-alive connection that dribbles one header byte a second is cut at the header deadline
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(0.5)
        cut = False
        for ch in b"GET /health HTTP/1.1\r\nHost: xxxxxxxxxx\r\n":
            try:
                s.sendall(bytes([ch]))
                if s.recv(1) == b"":
                    cut = True
                    break
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
        assert cut
        # over the limit: 503 and closed, /health still answered once the idle ones are gone
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(5)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
        for s in held:
            s.close()
        time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        with caplog.at_level("WARNING", logger="moetailor.server"):
            for _ in range(5):
                held = [socket.create_connection(("127.0.0.1", port)) for _ in range(41)]
                for s in held:
                    s.close()
        assert sum("shedding load" in r.message for r in caplog.records) <= 1
    finally:
        stop()


# ---- 5. big tokenizer work off the event loop -----------------------------------------------------
def test_tokenizer_endpoints_are_bounded(server):
    base, _, llm = server
    r = post(base, {"prompt": "x" * (32 * 512 + 1)}, path="/tokenize")
    assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = post(base, {"tokens": [5] * (32 * 512 + 1)}, path="/detokenize")
    assert r.status_code == 413 and "--max-detokenize-ids" in r.json()["error"]["message"]
    r = post(base, {"messages": [{"role": "user", "content": ""}] * 5000}, path="/v1/chat/completions")
    assert r.status_code == 413 and "--max-messages" in r.json()["error"]["message"]


def test_tokenizing_runs_off_the_event_loop(fresh):
    """While a slow tokenization runs, /health answers: it is not on the event loop."""
    import threading

    from moetailor.serving.server import ServerLimits

    class SlowTokenizer:
        def __init__(self, tok):
            self.tok = tok

        def encode(self, *a, **kw):
            time.sleep(2.0)
            return self.tok.encode(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

    real = fresh.tokenizer
    fresh.tokenizer = SlowTokenizer(real)
    base, _, stop = start_server(create_app(fresh, model_name="reference", limits=ServerLimits()))
    try:
        t = threading.Thread(target=lambda: post(base, {"prompt": "hello"}, path="/tokenize"))
        t.start()
        time.sleep(0.3)
        started = time.monotonic()
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert time.monotonic() - started < 1.5
        t.join()
    finally:
        fresh.tokenizer = real
        stop()


# ---- 7. malformed text and token ids are 400 naming the field ------------------------------------------
@pytest.mark.parametrize("path, raw, needle", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/completions", '{"prompt": "ab", "max_tokens": 2, "stop": ["\\udfff"]}', "stop[0]"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/detokenize", '{"tokens": [-1]}', "tokens"),
    ("/detokenize", '{"tokens": [18446744073709551616]}', "tokens"),
    ("/detokenize", '{"tokens": [99999]}', "vocabulary"),
])
def test_lone_surrogates_and_bad_token_ids_are_400(server, path, raw, needle):
    base, _, llm = server
    with httpx.Client(base_url=base, timeout=60) as client:   # one keep-alive connection throughout
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200        # the connection was kept
    assert not llm.has_unfinished()


# ---- 10. stream_options.include_usage -----------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_include_usage_ends_the_stream_with_a_usage_chunk(server, path, body):
    base, _, _ = server
    body = {**body, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    r = post(base, body, path)
    assert r.status_code == 200, r.text
    lines = [line for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 6 > 6
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = post(base, {**body, "stream": False, "stream_options": None}, path).json()["usage"]
    assert plain == last["usage"]
    # the official client reads it too
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="reference", prompt="hi", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert [c.usage for c in stream][-1].completion_tokens == 3
    r = post(base, {**body, "stream": False}, path)
    assert r.status_code == 400 and "stream: true" in r.json()["error"]["message"]


# ---- 11. chat messages in the forms the OpenAI API allows ---------------------------------------------
def test_chat_content_parts_and_tool_call_history(server):
    base, _, _ = server
    kw = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(base, {"messages": [{"role": "user", "content": "hello\nworld"}], **kw}, "/v1/chat/completions")
    parts = post(base, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                 {"type": "text", "text": "world"}]}], **kw},
                 "/v1/chat/completions")
    assert parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = post(base, {"messages": history, **kw}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    r = post(base, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                    **kw}, "/v1/chat/completions")
    assert r.status_code == 400 and "'image_url'" in r.json()["error"]["message"] and "content[0]" in r.text
    r = post(base, {"messages": [{"role": "user", "content": None}], **kw}, "/v1/chat/completions")
    assert r.status_code == 400 and "messages[0].content" in r.json()["error"]["message"]


# ---- low: small HTTP details ---------------------------------------------------------------------------
def test_small_http_details(server):
    base, _, _ = server
    assert httpx.head(base + "/health").status_code == 200
    r = httpx.get(base + "/v1/models/reference")
    assert r.status_code == 200 and r.json()["id"] == "reference"
    assert httpx.get(base + "/v1/models/other").status_code == 404
    r = post(base, {"prompt": "hi", "max_tokens": 2, "top_k": -1, "temperature": 0.7, "seed": 1})
    assert r.status_code == 200, r.text
    r = post(base, {"prompt": "hi", "max_tokens": 0.0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hi"


def test_echo_logprobs_on_multibyte_text_join_to_the_text(server):
    base, _, _ = server
    prompt = "naïve café — 東京 ok"
    r = post(base, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 5})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"] and c["text"].startswith(prompt)
    assert all(0 <= o <= len(c["text"]) for o in lp["text_offset"])
    assert [c["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]
    assert all(len(top) >= 5 for top in lp["top_logprobs"][1:])


def test_disaggregated_style_expert_plan_message(fresh):
    """The colocated server lists its plans without a dangling comma."""
    base, _, stop = start_server(create_app(fresh, model_name="reference"))
    try:
        r = post(base, {"prompt": "hi", "expert_plan": "nope"})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "default, full" in message and ", (" not in message
    finally:
        stop()


# ---- the engine-client contract (issue 28, item 2) ------------------------------------------------------
def test_both_engines_implement_the_engine_client_contract(reference):
    import inspect

    from moetailor.serving.client import EngineClient
    from moetailor.serving.disagg import DisaggregatedLLM

    assert isinstance(reference, EngineClient)
    assert reference.poll() == [] and reference.health() == {"ok": True, "workers": {}}
    wanted = {n for n, _ in inspect.getmembers(EngineClient, inspect.isfunction) if not n.startswith("_")}
    assert wanted <= set(dir(DisaggregatedLLM)), wanted - set(dir(DisaggregatedLLM))   # (attributes: set in __init__)
    from pathlib import Path

    import moetailor.serving.server as server

    files = sorted(Path(server.__file__).parent.glob("*.py"))
    assert len(files) > 1   # the package, every module of it
    source = "".join(f.read_text() for f in files)
    assert "getattr(llm" not in source and "getattr(self.llm" not in source
