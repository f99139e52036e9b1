"""Hostile-client probe of `moetailor serve` on the bundled reference model, one run.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/reliability_probe.py

Starts `moetailor serve reference --decode-plan P` (P: a uniform plan keeping half the experts in
decode, so the collapse guard shadows requests on the full pool) as a subprocess on 127.0.0.1 and
replays the worst cases of the reliability review, printing what happens now:

1. six good requests in flight, then one with temperature NaN (sent as a JSON NaN literal) and one
   with 1e-320: the statuses of all eight, and whether the server is still serving afterwards;
2. a 20 MB prompt: the status, how long it took, and the slowest /health answer meanwhile;
3. 500,000 stop strings: the status and the time;
4. 30 non-streaming clients that reset their connection mid-generation: seconds until
   ``moetailor_requests_running`` is back to 0.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(base: str) -> int:
    text = httpx.get(base + "/metrics", timeout=10).text
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("moetailor_requests_running"))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from moetailor.models import load_model
    from moetailor.plans import uniform_plan
    from moetailor.routing import LayerPolicy

    tmp = Path(tempfile.mkdtemp(prefix="moetailor-probe-"))
    model = load_model(args.model)
    from moetailor.models.adapters import moe_layers
    n = moe_layers(model)[0].num_experts
    uniform_plan(model, decode=LayerPolicy(keep=tuple(range(n // 2)))).save(tmp / "half.json")
    del model
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", args.model, "--decode-plan",
                             str(tmp / "half.json"), "--port", str(port), "--threads", str(args.threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        post = lambda body, **kw: httpx.post(base + "/v1/completions", content=body,  # noqa: E731
                                             headers={"content-type": "application/json"}, timeout=600, **kw)

        # 1. NaN / subnormal temperature next to good requests
        statuses = {}
        good = json.dumps({"prompt": "add 12 + 34 =", "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        threads = [threading.Thread(target=lambda i=i: statuses.__setitem__(f"good{i}", post(good).status_code))
                   for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        statuses["nan"] = post('{"prompt": "hi", "temperature": NaN, "max_tokens": 8}').status_code
        statuses["1e-320"] = post('{"prompt": "hi", "temperature": 1e-320, "max_tokens": 8}').status_code
        for t in threads:
            t.join()
        after = post(good).status_code
        print(f"1. statuses {dict(sorted(statuses.items()))}; a request afterwards: {after}")

        # 2. 20 MB prompt while /health is polled
        worst = [0.0]
        stop = threading.Event()

        def poll_health():
            while not stop.is_set():
                t0 = time.perf_counter()
                httpx.get(base + "/health", timeout=120)
                worst[0] = max(worst[0], time.perf_counter() - t0)
                time.sleep(0.05)
        poller = threading.Thread(target=poll_health)
        poller.start()
        t0 = time.perf_counter()
        r = post(json.dumps({"prompt": "word " * 4_000_000, "max_tokens": 4}))
        took = time.perf_counter() - t0
        stop.set()
        poller.join()
        print(f"2. 20 MB prompt: {r.status_code} in {took:.2f} s ({r.json()['error']['message'][:90]}); "
              f"slowest /health meanwhile {worst[0] * 1000:.0f} ms")

        # 3. 500,000 stop strings
        t0 = time.perf_counter()
        r = post(json.dumps({"prompt": "hi", "max_tokens": 4, "stop": ["zz"] * 500_000}))
        print(f"3. 500,000 stop strings: {r.status_code} in {time.perf_counter() - t0:.2f} s "
              f"({r.json()['error']['message'][:90]})")

        # 4. 30 reset non-streaming clients
        body = json.dumps({"prompt": "sort 5 3 9", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        for s in socks:
            s.sendall(head + body)
        deadline = time.time() + 120
        while running(base) < 30 and time.time() < deadline:
            time.sleep(0.05)
        peak = running(base)
        t0 = time.perf_counter()
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        while running(base) > 0 and time.perf_counter() - t0 < 120:
            time.sleep(0.02)
        print(f"4. 30 reset clients ({peak} running): requests_running {running(base)} after "
              f"{time.perf_counter() - t0:.2f} s")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
