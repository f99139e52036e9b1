"""Shared helpers for the engine tests (imported by name: tests/ is on sys.path through its conftest)."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import torch

from moetailor.models.tiny import char_tokenizer  # noqa: F401  (the tests import it from here)


def assert_stock(model) -> None:
    """A reference must be transformers' own model, untouched by an engine: every module a transformers
    or torch class carrying no attribute moetailor set, on transformers' own experts implementation.
    (``LLM(model)`` installs its kernels on the model it is given, so a reference is built beside it.)"""
    assert getattr(model.config, "_experts_implementation", None) != "moetailor", "the experts run moetailor's code"
    for name, module in model.named_modules():
        cls = type(module)
        assert cls.__module__.split(".")[0] in ("transformers", "torch"), f"{name or 'model'} is {cls.__qualname__}"
        touched = [k for k in vars(module) if "moetailor" in k]
        assert not touched, f"{name or 'model'} carries {touched}"


def stock_twin(model, **config):
    """An untouched stock model with ``model``'s weights, built on its own from its config (with
    ``config`` overrides, e.g. ``num_experts_per_tok``): the reference an engine is compared against.
    Call it before ``LLM(model)``, which packs the weights it is given."""
    import copy

    from transformers import AutoModelForCausalLM

    assert_stock(model)
    cfg = copy.deepcopy(model.config)
    for key, value in config.items():
        setattr(cfg, key, value)
    twin = AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype)
    twin.load_state_dict(model.state_dict())
    for name, buffer in model.named_buffers():      # non-persistent ones too (rotary tables, in their dtype)
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._buffers[leaf] = buffer.clone()
    assert_stock(twin)
    return twin.eval()


def stock_pruned_twin(model, plan):
    """The stock checkpoint ``moetailor prune`` writes for ``plan``'s decode pool, as a model object:
    transformers' own classes with only the kept experts (the SlimWise decode worker)."""
    from moetailor.transforms.artifacts import model_from_state
    from moetailor.transforms.prune import kept_per_layer, pruned_config, pruned_state

    assert_stock(model)
    state, count = pruned_state(model, kept_per_layer(plan, model))
    pruned = model_from_state(pruned_config(model.config, count), state, next(model.parameters()).dtype, "pruned")
    assert_stock(pruned)
    return pruned


def stock_handover(full, pruned, prompt: list[int], max_new_tokens: int) -> list[int]:
    """SlimWise with stock models only: ``full`` prefills the prompt, its transformers cache is handed to
    ``pruned``, which decodes greedily on it."""
    assert_stock(full)
    assert_stock(pruned)
    with torch.no_grad():
        out = full(torch.tensor([prompt]), use_cache=True)
        cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
        for _ in range(max_new_tokens - 1):
            out = pruned(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def random_prompts(lengths, vocab=96, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding involved), on a stock model."""
    assert_stock(model)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=1)
    return out[0, len(prompt):].tolist()


def start_server(app, limits=None):
    """uvicorn serving ``app`` on a free port of 127.0.0.1 in a thread: (base URL, port, stop). With
    ``limits`` (ServerLimits) it runs with the server's own connection bounds, as ``serve`` does."""
    import uvicorn

    from moetailor.serving.server import server_config

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
