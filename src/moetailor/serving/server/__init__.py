"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

One engine thread runs steps while requests are unfinished; HTTP handlers submit requests and read
per-request asyncio queues fed from that thread. Extension fields (beyond the OpenAI schema):
``expert_plan`` (name of a plan loaded at start-up with ``--expert-plan NAME=PATH``; "default" =
the engine's own plan, "full" = the full router) and ``expert_top_k`` (active experts per token).

Every request is checked once, before an engine sees it: each field's type and range (a float must
be finite), the body size, the prompt's characters before tokenizing, the stop strings; a field the
server does not implement is a 400 that says so. A request that fails inside the engine ends alone
with a short message and its request id (the traceback goes to the log).

The parts, one concept each:

==================  ==========================================================================
``limits``          ``ServerLimits``: what one request and one connection may ask for
``requests``        JSON -> ``SamplingParams``, prompt, logprob options; every range check
``loop``            ``AsyncEngine``: the engine thread and each request's delta queue
``responses``       the completion object, SSE streaming, disconnects, the error object
``metrics``         /metrics in Prometheus text format
``auth``            ``--api-key`` (Bearer token middleware)
``methods``         HEAD (as GET, without the body) and OPTIONS (204, ``Allow``) on every route
``connections``     uvicorn's h11 protocol with connection bounds, the uvicorn configuration
``app``             ``create_app`` (the routes) and ``serve``
==================  ==========================================================================
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
