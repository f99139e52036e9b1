"""Fourth reliability round (docs/reliability.md): logprob token bytes and pieces, the chat budget,
stop strings against logprobs, strict unimplemented fields, body deadlines and disconnects,
non-finite logits, HEAD / OPTIONS, batches, chat stream roles, unknown models. A real uvicorn
server on 127.0.0.1 over the bundled ``reference`` model (a tiny Qwen2-MoE with a byte-level BPE
tokenizer) unless a test says otherwise."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import char_tokenizer, idle, start_server

from moetailor.models.tiny import tiny_model
from moetailor.serving import LLM
from moetailor.serving.server import ServerLimits, create_app

ROOT = Path(__file__).resolve().parents[3]
ADD = {"prompt": "add 12 + 34", "max_tokens": 20, "temperature": 0}   # "\n2+4+0=6 c0 | 6\n1+3+0=" greedily
ACCENTS = "naïve café résumé naïve café"   # the chat answer to it is 12 lone continuation bytes (0xBA)


@pytest.fixture(scope="module")
def reference(one_thread):
    return LLM("reference", max_model_len=512)


@pytest.fixture(scope="module")
def server(reference):
    base, port, stop = start_server(create_app(reference, model_name="reference"),
                                    ServerLimits(body_timeout_s=1.0))
    yield base, port, reference
    stop()


def post(base, body, path="/v1/completions", **kw):
    return httpx.post(base + path, json=body, timeout=120, **kw)


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


def events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]


def streamed_logprobs(base, body, path="/v1/completions") -> tuple[str, list[str], list[int]]:
    """(text, tokens, text_offset) of a completions stream, joined over its chunks."""
    chunks = [e for e in events(post(base, {**body, "stream": True}, path)) if e.get("choices")]
    lps = [c["choices"][0]["logprobs"] or {} for c in chunks]
    return ("".join(c["choices"][0]["text"] for c in chunks), [t for lp in lps for t in lp.get("tokens", [])],
            [o for lp in lps for o in lp.get("text_offset", [])])


# ---- 1. chat logprob bytes are each token's own bytes ------------------------------------------------
def test_token_bytes_come_from_the_vocabulary(reference):
    from moetailor.serving.logprobs import TokenText

    text = TokenText(reference.tokenizer)
    ids = reference.tokenizer.encode("é 東", add_special_tokens=False)
    assert [list(text.raw(t)) for t in ids] == [[195], [169], [32], [230], [157], [177]]
    assert b"".join(text.raw(t) for t in ids) == "é 東".encode()
    assert text.raw(reference.tokenizer.eos_token_id) == b"<|endoftext|>"


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(server):
    base, _, llm = server
    r = post(base, chat(ACCENTS, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5), "/v1/chat/completions")
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["bytes"] for c in content] == [[0xBA]] * 12   # each token one lone continuation byte
    from moetailor.serving.logprobs import TokenText

    text = TokenText(llm.tokenizer)
    vocab = {bytes(text.raw(t)): t for t in range(len(llm.tokenizer))}
    for item in [c for entry in content for c in (entry, *entry["top_logprobs"])]:
        assert bytes(item["bytes"]) in vocab, item      # a token's bytes, never U+FFFD's [239, 191, 189]
    streamed = [c for e in events(post(base, chat(ACCENTS, max_tokens=12, temperature=0, logprobs=True, stream=True),
                                       "/v1/chat/completions"))
                for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["bytes"] for c in streamed] == [[0xBA]] * 12


# ---- 5. chat without max_tokens runs to the end of the context ---------------------------------------
def test_chat_without_max_tokens_is_not_cut_at_16(server):
    base, _, _ = server
    body = chat("hi", temperature=0, ignore_eos=True)
    r = post(base, body, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512   # the whole context
    r = post(base, {"prompt": "hi", "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16                 # completions keep OpenAI's 16
    r = post(base, chat("x " * 600, temperature=0), "/v1/chat/completions")
    assert r.status_code == 400 and "max_tokens" not in r.json()["error"]["message"], r.text


# ---- 6. stop strings and logprobs end together -----------------------------------------------------------
@pytest.mark.parametrize("stop, text, last", [("+0", "\n2+4", "4"),      # tokens "+", "0" wholly inside the stop
                                              ("c0", "\n2+4+0=6 ", " "),  # token " c" straddles the cut: " "
                                              ("6 c", "\n2+4+0=", "=")])
def test_logprob_tokens_end_where_a_stop_string_cuts_the_text(server, stop, text, last):
    base, _, _ = server
    for echo in (False, True):
        body = {**ADD, "logprobs": 0, "stop": [stop], "echo": echo}
        c = post(base, body).json()["choices"][0]
        lp, want = c["logprobs"], ("add 12 + 34" if echo else "") + text
        assert c["text"] == want and "".join(lp["tokens"]) == want and lp["tokens"][-1] == last
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert all(o < len(want) for o in lp["text_offset"])
        assert streamed_logprobs(base, body) == (want, lp["tokens"], lp["text_offset"])
    for stream in (False, True):
        r = post(base, chat("add 12 + 34", max_tokens=20, temperature=0, logprobs=True, stop=[stop], stream=stream),
                 "/v1/chat/completions")
        if stream:
            chunks = [e["choices"][0] for e in events(r)]
            content = "".join(c["delta"].get("content", "") for c in chunks)
            items = [i for c in chunks for i in c["logprobs"]["content"]]
        else:
            content = r.json()["choices"][0]["message"]["content"]
            items = r.json()["choices"][0]["logprobs"]["content"]
        assert content == "".join(i["token"] for i in items) == text
        assert b"".join(bytes(i["bytes"]) for i in items) == text.encode()


# ---- low: more than 8 undecodable tokens in a row ---------------------------------------------------------
def test_logprob_tokens_join_to_the_text_past_8_undecodable_tokens(server):
    base, _, llm = server
    c = post(base, {"prompt": "naïve café résumé", "max_tokens": 12, "temperature": 0, "logprobs": 0}
              ).json()["choices"][0]
    assert c["text"].count("\ufffd") == 12        # 12 lone continuation bytes
    assert "".join(c["logprobs"]["tokens"]) == c["text"]
    lone = llm.tokenizer.convert_tokens_to_ids("º")   # byte 0xBA alone
    c = post(base, {"prompt": [lone] * 12, "max_tokens": 0, "echo": True, "logprobs": 0}).json()["choices"][0]
    assert "".join(c["logprobs"]["tokens"]) == c["text"] == "\ufffd" * 12
    text, tokens, _ = streamed_logprobs(base, {"prompt": "naïve café résumé", "max_tokens": 12, "temperature": 0,
                                               "logprobs": 0})
    assert "".join(tokens) == text


# ---- low: echo of a prompt that fills the context ---------------------------------------------------------
def test_echo_of_a_prompt_that_fills_the_context_names_the_prompt(server):
    base, _, _ = server
    r = post(base, {"prompt": [5] * 512, "max_tokens": 0, "echo": True, "logprobs": 0})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_tokens=1" not in message and "512 tokens" in message, message
    assert "at most 511 tokens" in message
    r = post(base, {"prompt": [5] * 511, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 511


def test_echo_of_a_prompt_that_fills_the_kv_pool_names_the_pool(one_thread):
    llm = LLM("reference", max_model_len=512, num_kv_blocks=4, block_size=16)
    base, _, stop = start_server(create_app(llm, model_name="reference"))
    try:
        r = post(base, {"prompt": [5] * 64, "max_tokens": 0, "echo": True})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "max_tokens=1" not in message and "KV pool" in message, message
    finally:
        stop()


# ---- low: strings that are no neutral value ------------------------------------------------------------------
@pytest.mark.parametrize("path, body, name", [
    ("/v1/completions", {"prompt": "hi", "suffix": "none"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": "none"}, "logit_bias"),
    ("/v1/chat/completions", chat("hi", tools="none"), "tools"),
    ("/v1/chat/completions", chat("hi", echo=True), "echo"),
])
def test_unimplemented_fields_with_string_values_are_400(server, path, body, name):
    r = post(server[0], {**body, "max_tokens": 1}, path)
    assert r.status_code == 400 and f"{name}=" in r.json()["error"]["message"], r.text


def test_neutral_values_stay_accepted(server):
    base = server[0]
    r = post(base, {"prompt": "hi", "max_tokens": 1, "suffix": None, "logit_bias": {}, "echo": False})
    assert r.status_code == 200, r.text
    r = post(base, chat("hi", max_tokens=1, tools=[], tool_choice="none", echo=False, logit_bias=None),
             "/v1/chat/completions")
    assert r.status_code == 200, r.text


# ---- low: body deadline, disconnects during a body --------------------------------------------------------
def test_a_stalled_chunked_body_gets_408_naming_the_deadline(server):
    base, port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\n\r\n5\r\n{\"pro")   # a chunk, then nothing
        reply = b""
        while b"\r\n\r\n" not in reply or b"}" not in reply.split(b"\r\n\r\n", 1)[1]:
            data = s.recv(4096)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--body-timeout" in reply


def test_a_client_leaving_mid_body_is_one_log_line(server, caplog):
    base, port, llm = server
    with caplog.at_level(logging.INFO, logger="moetailor.server"):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 1000\r\n\r\n{\"prompt\": ")
                time.sleep(0.2)
        deadline = time.time() + 10
        while time.time() < deadline and len([r for r in caplog.records if "closed the connection" in r.message]) < 3:
            time.sleep(0.05)
    mine = [r for r in caplog.records if r.name == "moetailor.server"]
    assert len([r for r in mine if "closed the connection" in r.getMessage()]) == 3, [r.getMessage() for r in mine]
    assert not any(r.exc_info for r in mine)
    assert post(base, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_moetailor_serve_prints_the_line_for_a_client_leaving_mid_body(tmp_path):
    """The line is logged at INFO, which `moetailor serve` used to drop (no handler: Python prints only
    warnings): the user saw neither the traceback nor the line. It prints beside uvicorn's access lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = tmp_path / "serve.err"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(err, "w") as stderr:
        server = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--port", str(port),
                                   "--max-model-len", "256"], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and "Uvicorn running" not in err.read_text():
            assert server.poll() is None, err.read_text()[-2000:]
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.2)
        deadline = time.time() + 20
        while time.time() < deadline and "closed the connection" not in err.read_text():
            time.sleep(0.1)
    finally:
        server.terminate()
        server.wait(timeout=60)
    lines = [line for line in err.read_text().splitlines() if "closed the connection" in line]
    assert len(lines) == 1 and lines[0].startswith("INFO:") and "after 11 bytes of the request body" in lines[0], lines
    assert "Traceback" not in err.read_text()


# ---- low: non-finite logits ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_server(one_thread):
    model = tiny_model("qwen2_moe", vocab=128, seed=4)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")   # one NaN weight: every logit is NaN
    llm = LLM(model, tokenizer=char_tokenizer(), max_model_len=64)
    base, _, stop = start_server(create_app(llm, model_name="tiny", guard=False))
    yield base, llm
    stop()


@pytest.mark.parametrize("extra", [{}, {"temperature": 0}, {"logprobs": 2},
                                   {"logprobs": 2, "echo": True, "temperature": 0}])
def test_non_finite_logits_fail_the_request_with_a_json_error(nan_server, extra):
    base, llm = nan_server
    body = {"prompt": "hello", "max_tokens": 4, **extra}
    r = post(base, body)
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
    assert "NaN or infinite logits" in r.json()["error"]["message"]
    r = post(base, {**body, "stream": True})
    lines = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    parsed = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}")) for line in lines[:-1]]
    assert "NaN or infinite logits" in parsed[0]["error"]["message"]
    assert parsed[-1]["choices"][0]["finish_reason"] == "error"
    assert idle(llm) and httpx.get(base + "/health").status_code == 200


def test_token_logprobs_never_write_bare_nan():
    from moetailor.serving.logprobs import TokenLogprob, completion_logprobs

    class Text:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)
    lp = completion_logprobs([TokenLogprob(0, float("nan"), ((1, float("-inf")),))], ["a"], Text())
    json.dumps(lp, allow_nan=False)
    assert lp["token_logprobs"] == [None] and lp["top_logprobs"] == [{"b": -9999.0, "a": None}]


# ---- low: --decode-model with --expert-plan ------------------------------------------------------------------
def test_serve_refuses_expert_plans_with_a_decode_model_before_loading(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    plan = ROOT / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"
    r = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--decode-model",
                        str(tmp_path / "not-a-model"), "--expert-plan", f"half={plan}", "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--expert-plan needs a colocated engine" in r.stderr, r.stderr


# ---- low: HEAD and OPTIONS ------------------------------------------------------------------------------------------
def test_head_and_options(server):
    base = server[0]
    for path in ("/v1/models", "/v1/models/reference", "/metrics", "/health", "/tokenizer_info"):
        get, head = httpx.get(base + path), httpx.head(base + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"]
        r = httpx.options(base + path)
        assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "OPTIONS"}, path
    r = httpx.options(base + "/v1/chat/completions")
    assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"POST", "OPTIONS"}
    assert httpx.head(base + "/v1/completions").status_code == 405
    assert httpx.put(base + "/v1/models").status_code == 405
    assert httpx.options(base + "/nowhere").status_code == 404


def test_head_and_options_with_an_api_key(one_thread, reference):
    base, _, stop = start_server(create_app(reference, model_name="reference", api_key="k"))
    try:
        assert httpx.head(base + "/v1/models").status_code == 401
        assert httpx.head(base + "/v1/models", headers={"authorization": "Bearer k"}).status_code == 200
        assert httpx.options(base + "/v1/completions").status_code == 204
    finally:
        stop()


# ---- low: batches, chat roles in a stream, unknown models -----------------------------------------------------
@pytest.mark.parametrize("prompt", [[[1, 2], [3, 4]], ["a", "b"], [[1, 2], "a"]])
def test_a_batch_of_prompts_says_batches_are_not_supported(server, prompt):
    r = post(server[0], {"prompt": prompt, "max_tokens": 1})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "prompt holds 2 prompts (a batch)" in message and "one request per prompt" in message


def test_only_the_first_chat_delta_carries_the_role(server):
    chunks = [e["choices"][0]["delta"] for e in events(post(server[0], chat("hi", max_tokens=4, temperature=0,
                                                                            ignore_eos=True, stream=True),
                                                            "/v1/chat/completions"))]
    assert len(chunks) >= 4 and chunks[0]["role"] == "assistant"
    assert all("role" not in c for c in chunks[1:])


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat("hi")),
                                        ("/tokenize", {"prompt": "hi"})])
def test_an_unknown_model_is_404_model_not_found(server, path, body):
    r = post(server[0], {**body, "model": "gpt-9", "max_tokens": 1}, path)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.get(server[0] + "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
