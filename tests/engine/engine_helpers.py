"""Shared helpers for the engine tests (imported by name: tests/engine is on sys.path)."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import torch

from moetailor.models.tiny import char_tokenizer  # noqa: F401  (the tests import it from here)


def random_prompts(lengths, vocab=96, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding involved)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=1)
    return out[0, len(prompt):].tolist()


def start_server(app, limits=None):
    """uvicorn serving ``app`` on a free port of 127.0.0.1 in a thread: (base URL, port, stop). With
    ``limits`` (ServerLimits) it runs with the server's own connection bounds, as ``serve`` does."""
    import uvicorn

    from moetailor.engine.server import server_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = (uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning") if limits is None
              else server_config(app, "127.0.0.1", port, limits, log_level="warning"))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(base + "/health")
            break
        except httpx.HTTPError:
            time.sleep(0.05)

    def stop():
        srv.should_exit = True
        thread.join(timeout=10)
        app.state.engine.close()
    return base, port, stop


def idle(llm, seconds=15.0) -> bool:
    """Wait until the engine has no unfinished request (False after ``seconds``)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not llm.has_unfinished():
            return True
        time.sleep(0.05)
    return False
