"""Shared helpers for the engine tests (imported by name: tests/engine is on sys.path)."""
from __future__ import annotations

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


def serve_in_thread(app):
    """Run a FastAPI app with uvicorn in a daemon thread; returns (base URL, stop function)."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=5)
        app.state.engine.close()
    return base, stop
