"""Request parsing without a server: the one place each field's type and range is checked."""
from __future__ import annotations

import pytest

from moetailor.serving.server import ServerLimits
from moetailor.serving.server.requests import (
    BadRequest,
    TooLarge,
    completion_request,
    detokenize_request,
    resolve_plan,
    sampling_from,
    tokenize_request,
)


def test_sampling_fields_become_sampling_params():
    s = sampling_from({"prompt": "hi", "max_tokens": 16.0, "temperature": 0, "top_k": -1, "seed": 3,
                       "stop": "\n", "expert_top_k": 4.0})
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, s.stop, s.expert_top_k) == (16, 0.0, 0, 3, ("\n",), 4)
    assert type(s.expert_top_k) is int
    assert sampling_from({"max_completion_tokens": 5, "max_tokens": 9}).max_tokens == 5


@pytest.mark.parametrize("body, needle", [
    ({"expert_top_k": 0}, "expert_top_k=0 is out of range"),
    ({"expert_top_k": 2.5}, "expert_top_k must be an integer"),
    ({"expert_top_k": "x" * 5000}, "expert_top_k must be an integer"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"seed": -1}, "seed must be an integer in"),
    ({"stop": ["a"] * 17}, "--max-stop-strings"),
    ({"n": 2}, "n=2 is not implemented"),
    ({"presence_penalty": 3}, "must be in [-2, 2]"),
    ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ({"stream_options": {"include_usage": True}}, "only allowed with stream: true"),
])
def test_bad_fields_are_one_line_bad_requests(body, needle):
    with pytest.raises(BadRequest) as e:
        sampling_from(body, ServerLimits())
    assert needle in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300


def test_echo_with_no_tokens_scores_the_prompt_and_logprobs_need_a_tokenizer():
    sampling, extra = completion_request({"prompt": "hi", "echo": True, "max_tokens": 0, "logprobs": 2}, False,
                                         ServerLimits(), has_tokenizer=True)
    assert (extra.echo, extra.generate, extra.top) == (True, False, 2)
    assert (sampling.max_tokens, sampling.logprobs, sampling.prompt_logprobs) == (1, 2, 2)
    with pytest.raises(BadRequest, match="need the model's tokenizer"):
        completion_request({"prompt": "hi", "logprobs": 1}, False, ServerLimits(), has_tokenizer=False)
    with pytest.raises(BadRequest, match="top_logprobs needs logprobs: true"):
        completion_request({"messages": [], "top_logprobs": 2}, True, ServerLimits(), has_tokenizer=True)


def test_plan_names_are_checked_against_the_servers_plans():
    plans = {"full": "FULL", "half": "HALF"}
    assert resolve_plan({}, plans, colocated=True) == (None, None)
    assert resolve_plan({"expert_plan": "default"}, plans, colocated=True) == (None, None)
    assert resolve_plan({"expert_plan": "half"}, plans, colocated=True) == ("HALF", "half")
    with pytest.raises(BadRequest, match="this server has: default, full, half"):
        resolve_plan({"expert_plan": "nope"}, plans, colocated=True)
    with pytest.raises(BadRequest, match="a disaggregated server has only \"default\""):
        resolve_plan({"expert_plan": "half"}, {}, colocated=False)


def test_tokenizer_route_bodies():
    assert tokenize_request({"prompt": "hi", "add_special_tokens": True}, 10) == ("hi", True)
    with pytest.raises(TooLarge, match="--max-prompt-chars"):
        tokenize_request({"prompt": "x" * 11}, 10)
    with pytest.raises(BadRequest, match="unpaired UTF-16 surrogate"):
        tokenize_request({"prompt": "a\ud800"}, 10)
    assert detokenize_request({"tokens": [0, 5, 9]}, 4, 10) == [0, 5, 9]
    with pytest.raises(BadRequest, match=r"outside the tokenizer's vocabulary \(0\.\.9\)"):
        detokenize_request({"tokens": [10]}, 4, 10)
    with pytest.raises(TooLarge, match="--max-detokenize-ids"):
        detokenize_request({"tokens": [1] * 5}, 4, 10)
    with pytest.raises(BadRequest, match="list of token ids"):
        detokenize_request({"tokens": [True]}, 4, 10)
