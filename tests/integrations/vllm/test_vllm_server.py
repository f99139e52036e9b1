"""`moetailor serve --backend vllm`: vLLM's OpenAI server with the plugin (colocated, with a
decode plan and per-request expert_top_k) and the disaggregated pair behind moetailor's proxy."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from vllm_helpers import SKIP_REASON, engine_token_ids

pytest.importorskip("vllm", reason=SKIP_REASON)
httpx = pytest.importorskip("httpx", reason="httpx is needed to talk to the server")

N_PROMPTS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args, log_path) -> tuple[subprocess.Popen, str]:
    """`moetailor serve ARGS` in its own session, once it answers /health: (its process, its URL)."""
    port = free_port()
    # the pair takes port+1 and port+2: pick a port whose neighbours are free too
    while any(p != port and not _port_free(p) for p in (port + 1, port + 2)):
        port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", *args, "--port", str(port),
                             "--vllm-kv-cache-mib", "128", "--max-num-seqs", "8"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise AssertionError(f"server exited or did not start in 600 s: {open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def moetailor_serve(*args, log_path):
    proc, url = start_server(*args, log_path=log_path)
    try:
        yield url
    finally:
        stop(proc)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=300,
                      json={"model": "reference", "prompt": prompt, "max_tokens": 24, "temperature": 0.0, **extra})


def test_colocated_server_decode_plan_and_expert_top_k(prompts, quarter_plan, tmp_path):
    from moetailor.plans import Plan

    plan = Plan.load(quarter_plan).phase_aware()
    prompts = prompts[:N_PROMPTS]
    with moetailor_serve("reference", "--backend", "vllm", "--decode-plan", str(quarter_plan),
                         "--served-model-name", "reference", log_path=tmp_path / "serve.log") as url:
        plain = [complete(url, p, return_token_ids=True) for p in prompts]
        budget = [complete(url, p, return_token_ids=True, expert_top_k=3) for p in prompts]
        bad = complete(url, prompts[0], expert_top_k=9)
    assert all(r.status_code == 200 for r in plain + budget)
    expected = engine_token_ids(plan, prompts, max_tokens=24)
    assert expected != engine_token_ids(None, prompts, max_tokens=24), "the plan must change outputs to be tested"
    assert [r.json()["choices"][0]["token_ids"] for r in plain] == expected
    assert [r.json()["choices"][0]["token_ids"] for r in budget] == engine_token_ids(
        plan, prompts, expert_top_k=[3] * len(prompts), max_tokens=24)
    assert bad.status_code == 400
    assert "expert_top_k=9 is out of range" in bad.text


def test_disaggregated_pair_behind_the_proxy(prompts, quarter_plan, tmp_path):
    from moetailor.plans import Plan
    from moetailor.transforms import prune_checkpoint

    plan = Plan.load(quarter_plan)
    pruned = prune_checkpoint("reference", plan, tmp_path / "pruned")
    prompts = prompts[:N_PROMPTS]
    with moetailor_serve("reference", "--backend", "vllm", "--decode-model", str(pruned),
                         "--served-model-name", "reference", log_path=tmp_path / "pair.log") as url:
        got = [complete(url, p) for p in prompts]
        streamed = complete(url, prompts[0], stream=True)
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    expected = engine_token_ids(plan.phase_aware(), prompts, max_tokens=24)
    assert expected != engine_token_ids(None, prompts, max_tokens=24), "the plan must change outputs to be tested"
    assert [r.json()["choices"][0]["token_ids"] for r in got] == expected
    assert streamed.status_code == 400


def test_sigterm_to_moetailor_serve_writes_the_observed_statistics_and_stops_vllm(prompts, tmp_path):
    """`moetailor serve --backend vllm --observe FILE`, then SIGTERM to moetailor's process alone (what a
    service manager sends): the instance writes the traffic it served through its save route before it
    is stopped, and no vLLM process is left holding the port."""
    from moetailor.calibration import ExpertStats

    stats = tmp_path / "live.safetensors"
    proc, url = start_server("reference", "--backend", "vllm", "--observe", str(stats), "--vllm-no-prefix-caching",
                             "--served-model-name", "reference", log_path=tmp_path / "serve.log")
    try:
        answers = [complete(url, p, return_token_ids=True) for p in prompts[:3]]
        assert all(r.status_code == 200 for r in answers) and not stats.exists()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        stop(proc)
    log = (tmp_path / "serve.log").read_text()
    assert "observed statistics written before stopping" in log, log[-2000:]
    served = sum(r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] - 1 for r in answers)
    assert ExpertStats.load(stats).meta["tokens"] == served
    port = int(url.rsplit(":", 1)[1])
    deadline = time.time() + 60
    while not _port_free(port):
        assert time.time() < deadline, "a vLLM process still holds the port after moetailor serve stopped"
        time.sleep(1)


def test_sigkill_to_moetailor_serve_still_stops_vllm(tmp_path):
    """moetailor killed outright (SIGKILL, no cleanup of its own): the vLLM instance it started, in its own
    session, gets the parent-death SIGTERM and frees the port."""
    proc, url = start_server("reference", "--backend", "vllm", log_path=tmp_path / "serve.log")
    port = int(url.rsplit(":", 1)[1])
    try:
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 90
        while not _port_free(port):
            assert time.time() < deadline, "vLLM outlived the moetailor serve that started it"
            time.sleep(1)
    finally:
        stop(proc)
        subprocess.run(["pkill", "-f", f"api_server .*--port {port} "])     # an orphan, if this test failed
