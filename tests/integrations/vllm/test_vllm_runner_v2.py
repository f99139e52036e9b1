"""The v2 model-runner adapter (``runners.V2Adapter``, the only runner of vLLM 0.34.0) on vLLM's own
v2 classes: ``ModelState`` (the interface whose ``add_request`` / ``prepare_inputs`` the adapter
wraps on the runner's object), ``InputBatch``, ``NewRequestData``, ``SamplingParams``.

vLLM's CPU build 0.32.0 cannot run the v2 runner here ("Model Runner V2 requires Triton", and
Triton has no CPU backend), so no engine runs it; this checks the adapter on the classes instead.
It runs on 0.32.0's v2 classes in ``.venv-vllm``, and on 0.34.0's with an unpacked 0.34.0 wheel
first on the path (their pure-Python modules import without a GPU):

    pip download vllm==0.34.0 --no-deps -d /tmp/w && unzip -q /tmp/w/vllm-0.34.0-*.whl -d /tmp/vllm34
    PYTHONPATH=/tmp/vllm34:src .venv-vllm/bin/python -m pytest tests/integrations/vllm/test_vllm_runner_v2.py

``RequestState`` allocates pinned memory (CUDA only), so its one field the adapter reads,
``prompt_len.np``, is given on an uninitialised instance of the real class.
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from vllm_helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)


def _model_state():
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    seen = []

    def add_request(self, req_index, new_req_data):
        seen.append(("add", req_index, new_req_data.req_id))

    def prepare_inputs(self, input_batch, req_states):
        seen.append(("prepare", input_batch.num_reqs))
        return {"from_vllm": True}

    body = {m: (lambda self, *a, **k: None) for m in ModelState.__abstractmethods__}
    body.update(add_request=add_request, prepare_inputs=prepare_inputs)
    cls = type("TestState", (ModelState,), body)
    return cls.__new__(cls), seen


def _request(req_id: str, prompt: int, extra_args=None):
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    fields = {f.name: None for f in dataclasses.fields(NewRequestData) if f.default is dataclasses.MISSING}
    fields.update(req_id=req_id, prompt_token_ids=list(range(prompt)), mm_features=[], block_ids=([],),
                  num_computed_tokens=0, sampling_params=SamplingParams(max_tokens=4, extra_args=extra_args))
    if "prefill_token_ids" in fields:
        fields["prefill_token_ids"] = list(range(prompt))
    return NewRequestData(**fields)


def _batch(slots, scheduled, computed):
    from vllm.v1.worker.gpu.input_batch import InputBatch

    fields = {f.name: None for f in dataclasses.fields(InputBatch) if f.default is dataclasses.MISSING}
    fields.update(num_reqs=len(slots), idx_mapping_np=np.array(slots, dtype=np.intp),
                  num_scheduled_tokens=np.array(scheduled, dtype=np.int32),
                  num_computed_tokens_np=np.array(computed, dtype=np.int32))
    return InputBatch(**fields)


def _req_states(prompt_lens):
    from vllm.v1.worker.gpu.states import RequestState

    states = RequestState.__new__(RequestState)
    states.prompt_len = types.SimpleNamespace(np=np.array(prompt_lens, dtype=np.int32))
    return states


def test_the_v2_adapter_reads_each_token_phase_and_budget_from_vllms_own_objects():
    from moetailor.integrations.vllm.routing import StepTokens
    from moetailor.integrations.vllm.runners import watch_model_state

    state, seen = _model_state()
    tokens = StepTokens(8, 4, "cpu")
    req_states = _req_states([5, 0, 3, 0])            # slot -> prompt length
    watch_model_state(state, req_states, tokens)
    state.add_request(0, _request("b", 5, {"expert_top_k": 2}))
    state.add_request(2, _request("a", 3))
    # slot 2: 3 prompt tokens (prefill); slot 0: its 6th token, past its 5-token prompt (decode, k=2)
    out = state.prepare_inputs(_batch([2, 0], [3, 1], [0, 5]), req_states)
    assert out == {"from_vllm": True}
    assert seen == [("add", 0, "b"), ("add", 2, "a"), ("prepare", 2)]
    assert tokens.live.tolist() == [True] * 4 + [False] * 4
    assert tokens.decode.tolist()[:4] == [False, False, False, True]
    assert tokens.k.tolist() == [4, 4, 4, 2, 4, 4, 4, 4]
    # a chunk that ends the prompt and starts decoding: positions 2 (prompt) and 3 (decode)
    state.prepare_inputs(_batch([2], [2], [2]), req_states)
    assert tokens.decode.tolist()[:3] == [False, True, False] and tokens.live.tolist()[:3] == [True, True, False]
    # a slot reused by another request takes that request's budget
    state.add_request(0, _request("c", 1, {"expert_top_k": 3}))
    state.prepare_inputs(_batch([0], [1], [1]), _req_states([1, 0, 3, 0]))
    assert tokens.k.tolist()[:1] == [3] and tokens.decode.tolist()[:1] == [True]


def test_the_v2_classes_have_what_the_adapter_wraps_and_reads():
    """The registry's v2 entries on this vLLM's classes (0.32.0 here, or 0.34.0 with its wheel first)."""
    from moetailor.integrations.vllm import names as N
    from moetailor.integrations.vllm.patches import entry_problem

    for entry in N.REGISTRY:
        if entry.runner == "v2" and not entry.optional:
            assert entry_problem(entry) is None, entry.key
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner) and "load_model" not in CPUModelRunner.__dict__
