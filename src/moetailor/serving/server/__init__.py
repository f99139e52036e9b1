"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn); docs/architecture.md lists its
modules, one concept each.

One engine thread runs steps while requests are unfinished; HTTP handlers submit requests and read
per-request asyncio queues fed from that thread. Extension fields: ``expert_plan`` (a plan loaded
with ``--expert-plan NAME=PATH``; "default" = the engine's plan, "full" = the full router) and
``expert_top_k`` (active experts per token). Every request is checked once, before an engine sees
it; an unimplemented field is a 400 that says so. A request that fails inside the engine ends alone
with a short message and its request id (the traceback goes to the log).
"""
from .app import create_app, serve
from .auth import ApiKeyMiddleware, check_api_key
from .connections import http_protocol, server_config
from .limits import ServerLimits
from .loop import AsyncEngine
from .metrics import guard_metrics, prometheus_text
from .requests import BadRequest, LogprobRequest, TooLarge

__all__ = ["ApiKeyMiddleware", "AsyncEngine", "BadRequest", "LogprobRequest", "ServerLimits", "TooLarge",
           "check_api_key", "create_app", "guard_metrics", "http_protocol", "prometheus_text", "serve",
           "server_config"]
