"""Logprobs and echo against a direct transformers forward of the bundled model in float32: the
engine's per-token and prompt logprobs, the server's OpenAI shapes (completions with echo and
max_tokens 0, prompt lists, streaming, chat), the disaggregated server, and 400s for wrong types."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from engine_helpers import assert_stock, start_server

from moetailor.models import load_tokenizer
from moetailor.serving import LLM, SamplingParams
from moetailor.serving.server import create_app

TOL = 1e-4
PROMPTS = ["add 12 + 34\n", "sort 5 3 9 1\n", "reverse a b c d\n"]


@pytest.fixture(scope="module")
def reference():
    """The bundled checkpoint as stock transformers loads it, on its own (engines load their own copy)."""
    from transformers import AutoModelForCausalLM

    from moetailor.models.loading import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("reference"), dtype=torch.float32).eval()
    assert_stock(model)
    return model, load_tokenizer("reference")


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(token t+1 | tokens ..t) for every position: [T, V] from one plain transformers forward."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def check_entries(model, ids: list[int], start: int, values: list[float], tops: list[dict] | None = None, tok=None):
    """``values[i]`` is the logprob of ids[start + i]; ``tops[i]`` maps token text -> logprob."""
    ref = hf_logprobs(model, ids)
    for i, value in enumerate(values):
        t = start + i
        assert abs(value - ref[t - 1, ids[t]].item()) < TOL, (t, value, ref[t - 1, ids[t]].item())
        if tops is not None:
            for text, lp in tops[i].items():
                assert abs(lp - ref[t - 1, tok.encode(text, add_special_tokens=False)[0]].item()) < TOL


def test_engine_logprobs_equal_a_transformers_forward(reference):
    model, tok = reference
    llm = LLM("reference", tokenizer=tok, max_num_seqs=8)
    params = [SamplingParams(max_tokens=10, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=10, temperature=1.0, seed=7, logprobs=0),   # a sampled token: raw logprob
              SamplingParams(max_tokens=10)]                                         # no logprobs in the same batch
    outs = llm.generate(PROMPTS, params)
    for out, p in zip(outs[:2], params):
        ids = out.prompt_token_ids + out.token_ids
        n_prompt = len(out.prompt_token_ids)
        ref = hf_logprobs(model, ids)
        assert len(out.logprobs) == len(out.token_ids) and [e.token_id for e in out.logprobs] == out.token_ids
        check_entries(model, ids, n_prompt, [e.logprob for e in out.logprobs])
        for j, e in enumerate(out.logprobs):
            values, indices = ref[n_prompt - 1 + j].topk(p.logprobs)
            assert [t for t, _ in e.top] == indices.tolist()
            assert max(abs(lp - v) for (_, lp), v in zip(e.top, values.tolist())) < TOL if e.top else True
    first = outs[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(first.prompt_token_ids)
    check_entries(model, first.prompt_token_ids, 1, [e.logprob for e in first.prompt_logprobs[1:]])
    assert all(len(e.top) == 2 for e in first.prompt_logprobs[1:])
    assert outs[1].prompt_logprobs is None and outs[2].logprobs is None and outs[2].prompt_logprobs is None


def test_logprob_settings_are_validated():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


@pytest.fixture(scope="module")
def server(reference):
    model, tok = reference
    base, _, stop = start_server(create_app(LLM("reference", tokenizer=tok, max_num_seqs=8), model_name="reference"))
    yield base
    stop()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def test_echo_with_max_tokens_0_scores_the_prompt(server, reference):
    model, tok = reference
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "echo": True, "max_tokens": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice, ids = body["choices"][0], tok.encode(PROMPTS[0], add_special_tokens=False)
    lp = choice["logprobs"]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == PROMPTS[0]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    check_entries(model, ids, 1, lp["token_logprobs"][1:], lp["top_logprobs"][1:], tok)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert 2 <= len(top) <= 3 and value in top.values()    # the top 2 plus the prompt's own token


def test_token_id_prompts_echo_and_generated_logprobs(server, reference):
    """lm-eval's loglikelihood request (a batch of one token-id list, echo, max_tokens 1, logprobs 1)
    and generation."""
    model, tok = reference
    for ids in [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]:
        r = post(server, "/v1/completions", {"prompt": [ids], "echo": True, "max_tokens": 1, "logprobs": 1,
                                             "temperature": 0})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and c["text"].startswith(tok.decode(ids))
        full = ids + tok.encode(lp["tokens"][-1], add_special_tokens=False)
        check_entries(model, full, 1, lp["token_logprobs"][1:])

    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "logprobs": 3}
    c = post(server, "/v1/completions", body).json()["choices"][0]
    lp = c["logprobs"]
    ids = tok.encode(PROMPTS[1], add_special_tokens=False)
    generated = [tok.encode(t, add_special_tokens=False)[0] for t in lp["tokens"]]
    check_entries(model, ids + generated, len(ids), lp["token_logprobs"], lp["top_logprobs"], tok)
    assert lp["text_offset"][0] == 0
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [v for ch in chunks for v in (ch["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == lp["token_logprobs"]
    assert [o for ch in chunks for o in (ch["choices"][0]["logprobs"] or {}).get("text_offset", [])] == lp["text_offset"]


def test_chat_logprobs(server, reference):
    model, tok = reference
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "add 1 + 2"}],
                                              "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - TOL for c in content)
    assert bytes(content[0]["bytes"]).decode() == content[0]["token"]


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"prompt": "a", "logprobs": "3"}, "logprobs must be an integer"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs must be an integer"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "from 0 to 20"),
    ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo must be true or false"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "0 is allowed with echo: true"),
    ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, "prompt must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 3}, "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs must be"),
    ("/tokenize", {"prompt": 5}, "prompt must be a string"),
    ("/detokenize", {"tokens": ["a"]}, "tokens must be a list of token ids"),
])
def test_bad_logprob_requests_are_400(server, path, body, needle):
    r = post(server, path, body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_tokenizer_endpoints(server, reference):
    _, tok = reference
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token
    tokens = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    assert tokens == tok.encode(PROMPTS[0], add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == PROMPTS[0]


def test_disaggregated_server_returns_the_same_logprobs(reference):
    """Prompt logprobs come from the prefill worker, generated ones from both workers (the first
    token is sampled at prefill): all equal a transformers forward."""
    from moetailor.plans import uniform_plan
    from moetailor.serving.disagg import DisaggregatedLLM

    model, tok = reference
    llm = DisaggregatedLLM("reference", plan=uniform_plan(model), max_num_seqs=4)
    base, _, stop = start_server(create_app(llm, model_name="reference"))
    try:
        body = {"prompt": PROMPTS[2], "echo": True, "max_tokens": 6, "temperature": 0, "logprobs": 2}
        c = post(base, "/v1/completions", body).json()["choices"][0]
        lp = c["logprobs"]
        ids = tok.encode(PROMPTS[2], add_special_tokens=False)
        full = ids + [tok.encode(t, add_special_tokens=False)[0] for t in lp["tokens"][len(ids):]]
        assert len(lp["tokens"]) == len(ids) + 6 and lp["token_logprobs"][0] is None
        check_entries(model, full, 1, lp["token_logprobs"][1:], lp["top_logprobs"][1:], tok)
        r = post(base, "/v1/completions", {**body, "max_tokens": 0})
        assert r.json()["choices"][0]["text"] == PROMPTS[2]
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
    finally:
        stop()
