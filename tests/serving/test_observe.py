"""Calibration from served traffic: an engine observing N requests (prefill and decode) writes the
statistics `calibrate` computes on the same tokens, every tensor to float tolerance."""
from __future__ import annotations

import hashlib

import pytest
import torch
from engine_helpers import random_prompts

from moetailor.calibration import ExpertStats, calibrate_batches
from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams

MODEL = dict(model_type="qwen2_moe", vocab=128, seed=4)


def served_tokens(outputs) -> list[list[int]]:
    """What the engine ran per request: the prompt, then every completion token but the last."""
    return [o.prompt_token_ids + o.token_ids[:-1] for o in outputs]


def calibrated(runs: list[list[int]]) -> ExpertStats:
    """`calibrate` on the same tokens: each request's tokens one batch, on a fresh copy of the model."""
    digest = hashlib.sha256()
    batches = [torch.tensor([r]) for r in runs]
    for b in batches:
        digest.update(b.numpy().astype("<i8").tobytes())
    stats = calibrate_batches(tiny_model(**MODEL), batches, progress=False)
    stats.meta["data_sha256"] = digest.hexdigest()[:16]
    return stats


def assert_same_statistics(observed: ExpertStats, offline: ExpertStats) -> None:
    assert observed.meta["tokens"] == offline.meta["tokens"]
    assert observed.model == offline.model
    assert observed.layers.keys() == offline.layers.keys()
    for i, layer in offline.layers.items():
        got = observed.layers[i].tensors()
        assert got.keys() == layer.tensors().keys()
        for name, want in layer.tensors().items():
            torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-4, msg=f"layer {i} {name}")


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_observed_statistics_equal_calibration_on_the_same_tokens(tmp_path, one_thread, max_num_seqs):
    path = tmp_path / "observed.safetensors"
    llm = LLM(tiny_model(**MODEL), block_size=4, max_model_len=64, max_num_seqs=max_num_seqs, observe=path)
    outputs = llm.generate(random_prompts([5, 9, 3, 12], vocab=120, seed=1),
                           SamplingParams(max_tokens=7, ignore_eos=True))
    llm.close()
    observed = ExpertStats.load(path)   # the file `moetailor plan` reads
    runs = served_tokens(outputs)
    offline = calibrated(runs)
    assert_same_statistics(observed, offline)
    decode = sum(len(o.token_ids) - 1 for o in outputs)
    assert observed.meta["observed"]["decode_tokens"] == decode
    assert observed.meta["observed"]["prefill_tokens"] == sum(len(r) for r in runs) - decode
    assert observed.meta["data"] == "served traffic"
    if max_num_seqs == 1:   # one request at a time: the engine ran each request's tokens in calibration's order
        assert observed.meta["data_sha256"] == offline.meta["data_sha256"]


def test_observing_changes_no_output_and_writes_every_n_steps(tmp_path, one_thread):
    prompts = random_prompts([6, 4], vocab=120, seed=2)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    plain = LLM(tiny_model(**MODEL), block_size=4, max_model_len=64).generate(prompts, sampling)
    path = tmp_path / "every.safetensors"
    llm = LLM(tiny_model(**MODEL), block_size=4, max_model_len=64, observe=path, observe_every=2)
    seen = llm.generate(prompts, sampling)
    assert [o.token_ids for o in seen] == [o.token_ids for o in plain]
    assert path.is_file()   # written by the steps, before any close
    steps = ExpertStats.load(path).meta["observed"]["steps"]
    assert steps >= 2 and steps % 2 == 0
    assert not list(tmp_path.glob(".*tmp*"))   # atomic writes leave no temporary file


def test_preempted_requests_are_counted_once(tmp_path, one_thread):
    path = tmp_path / "preempt.safetensors"
    llm = LLM(tiny_model(**MODEL), block_size=4, num_kv_blocks=10, max_model_len=40, observe=path)
    outputs = llm.generate(random_prompts([8, 8, 8], vocab=120, seed=3), SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    llm.close()
    assert ExpertStats.load(path).meta["tokens"] == sum(len(r) for r in served_tokens(outputs))


def test_decode_plan_observes_the_full_routers_choices(tmp_path, one_thread):
    """Under a decode plan keeping experts 0-3 the observed routes still reach the others: the
    statistics count the full router's choices, not the plan's."""
    model = tiny_model(**MODEL)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)))
    path = tmp_path / "plan.safetensors"
    llm = LLM(model, plan, block_size=4, max_model_len=64, max_num_seqs=1, observe=path)
    outputs = llm.generate([[5]], SamplingParams(max_tokens=24, ignore_eos=True))   # a 1-token prompt: decode steps
    llm.close()
    stats = ExpertStats.load(path)
    assert stats.meta["tokens"] == 24
    for layer in stats.layers.values():
        assert layer.frequency[4:].sum() > 0       # experts the plan drops, chosen by the full router
        assert layer.frequency.sum() == 24 * model.config.num_experts_per_tok
    assert outputs[0].token_ids


def existing(path):
    path.write_bytes(b"statistics of an earlier run")
    return path


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing" / "s.safetensors", "does not exist"),
    (lambda d: d, "is a directory"),
    (lambda d: existing(d / "old.safetensors"), "already exists"),
])
def test_unwritable_observe_path_fails_before_the_model_loads(tmp_path, make, needle):
    with pytest.raises(ValueError, match=needle):
        LLM("/nonexistent/model", observe=make(tmp_path))   # the model path is never read


def test_server_observes_writes_on_demand_and_at_shutdown(tmp_path, one_thread):
    """`moetailor serve --observe`'s engine behind the HTTP server: POST /observe/save (behind the API
    key like every path) writes the file at once, stopping the server writes it again, and the
    statistics equal calibration on the served tokens."""
    import httpx
    from engine_helpers import start_server

    from moetailor.models.tiny import char_tokenizer
    from moetailor.serving.server import create_app

    path = tmp_path / "served.safetensors"
    llm = LLM(tiny_model(**MODEL), tokenizer=char_tokenizer(), block_size=4, max_model_len=64, observe=path)
    base, _, stop = start_server(create_app(llm, model_name="tiny", api_key="k"))
    auth = {"Authorization": "Bearer k"}
    prompts = ("hello wor", "the quick")
    texts = []
    try:
        for prompt in prompts:
            r = httpx.post(base + "/v1/completions", headers=auth, timeout=30,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            texts.append(r.json()["choices"][0]["text"])
        # the tokens the server ran: the same greedy requests on an engine that returns token ids
        outputs = LLM(tiny_model(**MODEL), tokenizer=char_tokenizer(), block_size=4, max_model_len=64).generate(
            list(prompts), SamplingParams(max_tokens=6, ignore_eos=True))
        assert [o.text for o in outputs] == texts
        runs = served_tokens(outputs)
        assert httpx.post(base + "/observe/save").status_code == 401
        saved = httpx.post(base + "/observe/save", headers=auth).json()
        assert saved["tokens"] == sum(map(len, runs)) and path.is_file()
        path.unlink()
    finally:
        stop()
    assert_same_statistics(ExpertStats.load(path), calibrated(runs))   # written again at shutdown


def test_serve_refuses_an_unwritable_observe_path_before_loading(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--observe",
                        str(tmp_path / "no-such-dir" / "s.safetensors")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_refuses_an_observe_path_another_run_is_writing(tmp_path):
    """Two servers observing into one file would each replace the other's statistics at every save: the
    second `serve --observe` fails at argument checking, naming the run that holds the path."""
    import subprocess
    import sys

    from moetailor.outputs import claim_output, release_outputs

    path = tmp_path / "live.safetensors"
    claim_output(path, "--observe")    # this process plays the first server
    try:
        r = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--observe", str(path)],
                           capture_output=True, text=True, timeout=120)
    finally:
        release_outputs()
    assert r.returncode == 2
    assert "being written by another moetailor run" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
