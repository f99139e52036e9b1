"""Disaggregated serving under faults: each worker killed mid-stream (every request ends, completed
or with a clear error; the server reports it on /health and recovers), a poisoned request does not
take a worker down, a checkpoint that cannot load fails the start with its cause, and no worker
outlives a SIGKILLed server. `moetailor serve --decode-model` runs as a real subprocess."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from engine_helpers import char_tokenizer

from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import SamplingParams
from moetailor.serving.disagg import DisaggregatedLLM, RemoteSequence
from moetailor.serving.wire import Add
from moetailor.transforms.prune import prune_checkpoint

KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = tiny_model("qwen2_moe", vocab=128, seed=5, num_experts=16, expert_width=64, max_position_embeddings=4096)
    model.save_pretrained(root / "full")
    char_tokenizer().save_pretrained(root / "full")
    prune_checkpoint(model, uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5, 7, 9, 11))), root / "pruned")
    return root


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is dead too (its parent, the killed server, never reaped it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(check, seconds: float, step: float = 0.1):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    return None


def health(base):
    try:
        r = httpx.get(base + "/health", timeout=5)
        return r.status_code, r.json()
    except httpx.HTTPError:
        return None, {}


def stream(base, body, out: list, started: threading.Event | None = None) -> None:
    """Read an SSE completion to its end; out gets ("chunk", text, finish_reason) and ("error", message)."""
    with httpx.stream("POST", base + "/v1/completions", json=dict(body, stream=True), headers=AUTH,
                      timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.append(("done",))
                break
            event = json.loads(data)
            if "error" in event:
                out.append(("error", event["error"]["message"]))
                continue
            out.append(("chunk", event["choices"][0]["text"], event["choices"][0]["finish_reason"]))
            if started is not None and len(out) >= 3:
                started.set()


def start_streams(base, n: int, max_tokens: int):
    outs, threads, started = [[] for _ in range(n)], [], []
    for i in range(n):
        ev = threading.Event()
        t = threading.Thread(target=stream, args=(base, {"prompt": f"abc{i}", "max_tokens": max_tokens,
                                                         "temperature": 0, "ignore_eos": True}, outs[i], ev))
        t.start()
        threads.append(t)
        started.append(ev)
    for ev in started:
        assert ev.wait(120), "a stream never started"
    return outs, threads


def recovered(base, old_pid: int, kind: str):
    """/health back to 200 with a new pid for ``kind``; returns whether a non-200 was seen first."""
    seen_down = False
    deadline = time.time() + 180
    while time.time() < deadline:
        code, body = health(base)
        if code == 200 and body["workers"][kind]["pid"] != old_pid:
            return seen_down, body
        if code == 503 and body.get("workers", {}).get(kind, {}).get("state") != "ready":
            seen_down = True
        time.sleep(0.05)
    raise AssertionError(f"the {kind} worker did not come back: {health(base)}")


def test_served_server_survives_worker_deaths_and_leaves_no_orphans(checkpoints):
    root = checkpoints
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, MOETAILOR_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", str(root / "full"),
                             "--decode-model", str(root / "pruned"), "--port", str(port), "--threads", "1",
                             "--block-size", "4", "--max-model-len", "4096"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = set()
    try:
        assert wait_for(lambda: health(base)[0] == 200, 300), f"server did not start: {proc.poll()}"
        code, body = health(base)
        pids |= {w["pid"] for w in body["workers"].values()}
        assert len(pids) == 2 and all(w["state"] == "ready" for w in body["workers"].values())

        # the model id is the folder name, never its path; the key is checked (env var), /health is open
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "full"
        r = httpx.post(base + "/v1/completions", json={"model": "x", "prompt": "hi"}, headers=AUTH)
        assert r.status_code == 404 and str(root) not in r.text

        # the same 400s as a colocated server, before either worker sees the request
        for bad, needle in (({"prompt": [1, 500]}, "vocabulary"), ({"prompt": "hi", "expert_top_k": 99}, "expert_top_k"),
                            ({"prompt": "hi", "seed": 2**63}, "seed"), ({"prompt": "hi", "temperature": 1e-320},
                                                                       "temperature")):
            r = httpx.post(base + "/v1/completions", json=bad, headers=AUTH)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text

        # decode worker killed mid-stream: every stream ends with a clear error, then the server recovers
        outs, threads = start_streams(base, 3, 3000)

        def usage():
            metrics = httpx.get(base + "/metrics", headers=AUTH).text
            return float(next(line.split()[-1] for line in metrics.splitlines()
                              if line.startswith("moetailor_kv_cache_usage")))
        assert wait_for(lambda: usage() > 0, 10), "the decode worker's real cache usage, not a constant"
        decode_pid = body["workers"]["decode"]["pid"]
        os.kill(decode_pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for out in outs:
            assert out[-1] == ("done",)
            assert any(e[0] == "error" and "decode worker exited" in e[1] for e in out)
            assert out[-2][2] == "error"
        seen_down, body = recovered(base, decode_pid, "decode")
        assert seen_down and body["workers"]["decode"]["restarts"] == 1
        pids.add(body["workers"]["decode"]["pid"])
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "ignore_eos": True},
                       headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5

        # prefill worker killed while streams decode: they complete; /health notices at once (no request
        # needed) and a request sent during the restart is served once the new worker is up
        outs, threads = start_streams(base, 2, 300)
        prefill_pid = body["workers"]["prefill"]["pid"]
        os.kill(prefill_pid, signal.SIGKILL)
        assert wait_for(lambda: health(base)[0] == 503, 10), "/health did not notice the dead prefill worker"
        late = httpx.post(base + "/v1/completions", json={"prompt": "xyz", "max_tokens": 4, "ignore_eos": True},
                          headers=AUTH, timeout=180)
        assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"] == "length"
        for t in threads:
            t.join(120)
        for out in outs:
            assert out[-1] == ("done",) and out[-2][2] == "length"
        seen_down, body = recovered(base, prefill_pid, "prefill")
        pids.add(body["workers"]["prefill"]["pid"])
        assert body["workers"]["prefill"]["restarts"] == 1

        # a worker that dies while the server is idle: /health says so without any request
        decode_pid = body["workers"]["decode"]["pid"]
        os.kill(decode_pid, signal.SIGKILL)
        seen_down, body = recovered(base, decode_pid, "decode")
        assert seen_down and body["workers"]["decode"]["restarts"] == 2
        pids.add(body["workers"]["decode"]["pid"])
        live = {w["pid"] for w in body["workers"].values()}
        assert all(alive(p) for p in live) and not any(alive(p) for p in pids - live)

        # SIGKILL of the server: its workers follow it
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_for(lambda: not any(alive(p) for p in live), 10), \
            f"workers outlived the server: {[p for p in live if alive(p)]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_poisoned_request_does_not_take_a_worker_down(checkpoints):
    root = checkpoints
    with DisaggregatedLLM(str(root / "full"), decode_model=str(root / "pruned"), block_size=4,
                          max_model_len=256, threads=1) as dis:
        good = dis.add_request("hello", SamplingParams(max_tokens=8, ignore_eos=True))
        bad_sampling = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
        bad_sampling.temperature = float("nan")    # fault injection: past the front end's checks
        with dis.lock:
            bad = dis.seqs["bad"] = RemoteSequence("bad", None, [5, 6, 7], bad_sampling)
            dis.workers["prefill"].inbox.put(Add("bad", [5, 6, 7], bad_sampling))
        while not (good.is_finished and bad.is_finished):
            dis.step()
        assert good.finish_reason == "length"
        assert bad.finish_reason == "error" and "temperature" in bad.error
        assert dis.restarts == {"prefill": 0, "decode": 0}
        assert dis.generate(["abc"], SamplingParams(max_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_a_checkpoint_that_cannot_load_fails_the_start_with_its_cause(checkpoints, tmp_path):
    import shutil

    root = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(root / "pruned", broken)
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ValueError, match="decode worker could not start: .*(weights|Safetensor)") as info:
        DisaggregatedLLM(str(root / "full"), decode_model=str(broken), block_size=4, max_model_len=256, threads=1)
    assert len(str(info.value).splitlines()) == 1
