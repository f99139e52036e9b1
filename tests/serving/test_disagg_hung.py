"""A disaggregated worker that stops answering without dying (SIGSTOP): its heartbeat stops, the
server kills it, ends its requests with an error, answers 503 on /health until a new worker is
ready, serves again, and a SIGTERM with a hung worker ends the server within a bound.
`moetailor serve --decode-model` runs as a real subprocess."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from engine_helpers import char_tokenizer
from test_disagg_faults import alive, health, recovered, start_streams, wait_for

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.transforms.prune import prune_checkpoint

TIMEOUT = 3.0   # --heartbeat-timeout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hung")
    model = tiny_model("qwen2_moe", vocab=128, seed=5, num_experts=16, expert_width=64, max_position_embeddings=4096)
    model.save_pretrained(root / "full")
    char_tokenizer().save_pretrained(root / "full")
    prune_checkpoint(model, uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5, 7, 9, 11))), root / "pruned")
    return root


def test_a_stopped_worker_is_detected_failed_replaced_and_shutdown_is_bounded(checkpoints):
    root = checkpoints
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, MOETAILOR_API_KEY="test-key")
    proc = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", str(root / "full"),
                             "--decode-model", str(root / "pruned"), "--port", str(port), "--threads", "1",
                             "--block-size", "4", "--max-model-len", "4096", "--heartbeat-timeout", str(TIMEOUT)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = set()
    try:
        assert wait_for(lambda: health(base)[0] == 200, 300), f"server did not start: {proc.poll()}"
        body = health(base)[1]
        pids |= {w["pid"] for w in body["workers"].values()}
        outs, threads = start_streams(base, 2, 3000)
        decode_pid = body["workers"]["decode"]["pid"]
        os.kill(decode_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a stream still hangs on the stopped worker"
        assert time.monotonic() - stopped < 30
        for out in outs:
            assert out[-1] == ("done",) and out[-2][2] == "error"
            assert any(e[0] == "error" and "decode worker stopped answering" in e[1] for e in out), out[-3:]
        seen_down, body = recovered(base, decode_pid, "decode")
        assert body["workers"]["decode"]["restarts"] == 1
        assert wait_for(lambda: not alive(decode_pid), 10), "the stopped worker was not killed"
        pids.add(body["workers"]["decode"]["pid"])
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "ignore_eos": True},
                       headers={"authorization": "Bearer test-key"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        # the disaggregated server's expert_plan error: no dangling "default, ", no flag it refuses
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "expert_plan": "half"},
                       headers={"authorization": "Bearer test-key"}, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "default, " not in message and "--expert-plan" not in message, message

        # stopped while idle: /health says 503 without any request
        decode_pid = body["workers"]["decode"]["pid"]
        os.kill(decode_pid, signal.SIGSTOP)
        assert wait_for(lambda: health(base)[0] == 503, 20), "/health did not notice the stopped worker"
        # SIGTERM with a stopped worker: the server ends within a bound
        proc.send_signal(signal.SIGTERM)
        proc.wait(40)
        pids.add(decode_pid)
        assert wait_for(lambda: not any(alive(p) for p in pids), 10), [p for p in pids if alive(p)]
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
