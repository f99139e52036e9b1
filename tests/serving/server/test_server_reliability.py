"""One bad request must not take the server down: finite sampling fields, failures isolated to their
request (and its guard shadow), size limits, aborts on client disconnect, strict field types,
unimplemented fields named, short engine errors, API keys, a model without tokenizer files.
A real uvicorn server on 127.0.0.1 over a tiny model."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from engine_helpers import char_tokenizer, idle, start_server

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams
from moetailor.serving.guard import GuardConfig, shadow_id
from moetailor.serving.server import ServerLimits, create_app

MAX_LEN = 8192       # long enough that a dropped request could not finish on its own during a test


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_moe", vocab=128, seed=4, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def server(one_thread, model):
    llm = LLM(model, tokenizer=char_tokenizer(), block_size=16, num_kv_blocks=4600, max_model_len=MAX_LEN)
    plans = {"half": uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))}
    app = create_app(llm, model_name="tiny", plans=plans,
                     limits=ServerLimits(max_request_bytes=64 * 1024, max_prompt_chars=20_000))
    base, port, stop = start_server(app)
    yield base, port, llm
    stop()


def post(base, body, path="/v1/completions", **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)   # json.dumps writes NaN / Infinity
    return httpx.post(base + path, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


# ---- finite, in-range sampling fields -------------------------------------------------------------
@pytest.mark.parametrize("raw, needle", [
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "hi", "temperature": 1e-320}', "temperature"),
    ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "hi", "top_p": NaN}', "top_p"),
    ('{"prompt": "hi", "presence_penalty": NaN}', "presence_penalty"),
    ('{"prompt": "hi", "seed": 9223372036854775808}', "seed"),
    ('{"prompt": "hi", "seed": 1180591620717411303424}', "seed"),
    ('{"prompt": [1, 5000]}', "outside the vocabulary"),
    ('{"prompt": "hi", "expert_top_k": 99}', "expert_top_k"),
])
def test_non_finite_or_out_of_range_fields_are_400_naming_the_field(server, raw, needle):
    base, _, llm = server
    r = post(base, raw)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert not llm.has_unfinished()


def test_sampling_params_reject_nan_and_subnormal():
    for kw in ({"temperature": float("nan")}, {"temperature": 1e-320}, {"top_p": float("nan")},
               {"temperature": float("inf")}, {"seed": 2**63}, {"seed": -1}, {"ignore_eos": "false"},
               {"max_tokens": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_generate_cli_rejects_nan_temperature_in_one_line(capsys):
    from moetailor.cli.main import main

    assert main(["generate", "reference", "--prompt", "x", "--temperature", "nan"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "temperature" in err and "finite" in err


# ---- a failing request fails alone ----------------------------------------------------------------
def poison(seq) -> None:
    """Fault injection: a sampling state the validation would have refused (the draw raises)."""
    seq.sampling.temperature = float("nan")


def test_a_request_failing_in_the_step_fails_alone_with_its_shadow(one_thread, model):
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))
    llm = LLM(model, plan, tokenizer=char_tokenizer(), block_size=4, max_model_len=128,
              guard=GuardConfig(shadow_fraction=1.0))
    good = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in ("abc", "hello", "xyz")]
    bad = llm.add_request("oops", SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    shadow = llm._seqs[shadow_id(bad.request_id)]
    poison(bad)
    while llm.has_unfinished():
        llm.step()
    assert [s.finish_reason for s in good] == ["length"] * 3
    assert bad.finish_reason == "error" and "internal error" in bad.error
    assert shadow.is_finished and shadow.request_id not in llm._seqs
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    # a shadow that fails is removed too, and the engine keeps serving
    again = llm.add_request("abc", SamplingParams(max_tokens=6, ignore_eos=True))
    poison(llm._seqs[shadow_id(again.request_id)])
    while llm.has_unfinished():
        llm.step()
    assert again.finish_reason == "length" and not llm._seqs


def test_one_failing_request_does_not_fail_concurrent_http_requests(server):
    base, _, llm = server
    results = []

    def call(prompt):
        results.append(post(base, {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}))
    threads = [threading.Thread(target=call, args=(p,)) for p in ("abc", "defg", "hij", "klmno")]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while len(llm.scheduler.running) < 4 and time.time() < deadline:
        time.sleep(0.01)
    with llm.lock:   # a fifth request in the same steps, one whose sampling raises
        poison(llm.add_request("zzz", SamplingParams(max_tokens=60, temperature=1.0, ignore_eos=True)))
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4
    assert httpx.get(base + "/health").json()["status"] == "ok"
    assert idle(llm)


def test_engine_error_is_a_short_message_with_the_request_id(server):
    base, _, llm = server
    box = {}
    thread = threading.Thread(target=lambda: box.update(r=post(base, {"prompt": "abc", "max_tokens": 200,
                                                                      "temperature": 0.5, "ignore_eos": True})))
    thread.start()
    deadline = time.time() + 30
    while not llm._seqs and time.time() < deadline:
        time.sleep(0.005)
    with llm.lock:
        for seq in llm._seqs.values():
            poison(seq)
    thread.join()
    r = box["r"]
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "cmpl-" in message and "internal error" in message and "probability" not in message
    assert post(base, {"prompt": "abc", "max_tokens": 3}).status_code == 200


# ---- size limits ---------------------------------------------------------------------------------
def test_oversized_body_is_413_naming_the_limit(server):
    base, _, llm = server
    r = post(base, {"prompt": "x" * 100_000})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():   # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'
    r = httpx.post(base + "/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413


def test_long_prompt_is_413_before_tokenizing(server):
    base, _, llm = server
    r = post(base, {"prompt": "x" * 30_000})
    assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = post(base, {"messages": [{"role": "user", "content": "y" * 15_000}] * 2}, path="/v1/chat/completions")
    assert r.status_code == 413


@pytest.mark.parametrize("stop, needle", [(["a"] * 17, "--max-stop-strings"), (["b" * 300], "--max-stop-chars")])
def test_stop_strings_are_bounded(server, stop, needle):
    r = post(server[0], {"prompt": "hi", "stop": stop})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


# ---- client disconnect ---------------------------------------------------------------------------
def test_dropped_non_streaming_requests_are_aborted(server):
    """Requests that would run 8000 tokens: only an abort on disconnect ends them during the test."""
    base, port, llm = server
    body = json.dumps({"prompt": "abc", "max_tokens": 8000, "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + body)
        socks.append(s)
    deadline = time.time() + 30
    while len(llm.scheduler.running) < 6 and time.time() < deadline:
        time.sleep(0.01)
    assert len(llm.scheduler.running) == 6
    for s in socks:   # reset, as a client that crashed
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    assert idle(llm), f"{len(llm.scheduler.running)} dropped requests still running"
    assert "moetailor_requests_running 0" in httpx.get(base + "/metrics").text


# ---- strict types, unimplemented fields ---------------------------------------------------------
@pytest.mark.parametrize("body, needle", [
    ({"prompt": "hi", "ignore_eos": "false"}, "ignore_eos"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "best_of": 2}, "not implemented"),
    ({"prompt": "hi", "n": 2}, "not implemented"),
    ({"prompt": "hi", "frequency_penalty": 0.5}, "not implemented"),
    ({"prompt": "hi", "logit_bias": {"5": 10}}, "not implemented"),
    ({"prompt": "hi", "min_p": 0.1}, "does not implement"),
    ({"prompt": ["a", "b"]}, "not implemented"),
    ({"prompt": "hi", "expert_plan": "nope"}, "--expert-plan NAME=PATH"),
])
def test_wrong_types_and_unimplemented_fields_are_400(server, body, needle):
    r = post(server[0], body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_chat_role_must_be_a_known_string(server):
    r = post(server[0], {"messages": [{"role": 5, "content": "hi"}]}, path="/v1/chat/completions")
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_neutral_values_of_unimplemented_fields_are_accepted(server):
    r = post(server[0], {"prompt": "hi", "max_tokens": 2.0, "n": 1, "best_of": 1, "presence_penalty": 0, "user": "me"})
    assert r.status_code == 200, r.text


# ---- authentication ------------------------------------------------------------------------------
def test_api_key_on_every_endpoint_but_health(one_thread, model):
    llm = LLM(model, tokenizer=char_tokenizer(), block_size=4, max_model_len=64)
    base, _, stop = start_server(create_app(llm, model_name="tiny", api_key="sekrit"))
    try:
        assert httpx.get(base + "/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/docs"):
            assert httpx.get(base + path).status_code == 401
        assert post(base, {"prompt": "hi", "max_tokens": 2}).status_code == 401
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 200
        from openai import AuthenticationError, OpenAI
        assert OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0).models.list().data[0].id == "tiny"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        stop()


# ---- model id, tokenizer ----------------------------------------------------------------------
def test_served_model_name_is_the_folder_name_never_the_path(tmp_path):
    from moetailor.cli.serve import served_model_name

    assert served_model_name(str(tmp_path / "my-model"), None) == "my-model"
    assert served_model_name(str(tmp_path / "my-model") + "/", None) == "my-model"
    assert served_model_name("reference", None) == "reference"
    assert served_model_name(str(tmp_path), "alias") == "alias"


def test_model_without_tokenizer_files_says_so(one_thread, model, tmp_path):
    model.save_pretrained(tmp_path / "no-tokenizer")
    llm = LLM(str(tmp_path / "no-tokenizer"), block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="no tokenizer files"):
        llm.add_request("hello", SamplingParams(max_tokens=2))
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
    base, _, stop = start_server(create_app(llm, model_name="no-tokenizer"))
    try:
        r = post(base, {"prompt": "hello"})
        assert r.status_code == 400 and "no tokenizer files" in r.json()["error"]["message"]
        r = post(base, {"messages": [{"role": "user", "content": "hello"}]}, path="/v1/chat/completions")
        assert r.status_code == 400 and "no tokenizer files" in r.json()["error"]["message"]
    finally:
        stop()
