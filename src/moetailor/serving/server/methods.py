"""HEAD and OPTIONS on every route (RFC 9110): HEAD is answered as GET without the body wherever GET
is, OPTIONS with 204 and the path's methods in ``Allow``; a method a path does not have stays 405
(with ``Allow``), an unknown path 404."""
from __future__ import annotations

from starlette.routing import Match


def allowed_methods(router, scope) -> set[str]:
    """The methods the routes matching ``scope``'s path accept (empty: no route has this path)."""
    methods: set[str] = set()
    for route in router.routes:
        match, _ = route.matches({**scope, "method": "GET"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    if "GET" in methods:
        methods.add("HEAD")
    return methods | {"OPTIONS"} if methods else methods


class MethodsMiddleware:
    """Pure ASGI (streaming and disconnects pass through): HEAD and OPTIONS for every route."""

    def __init__(self, app, router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        methods = allowed_methods(self.router, scope)
        if not methods:                      # no such path: the app's 404
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204,
                        "headers": [(b"allow", ", ".join(sorted(methods)).encode())]})
            await send({"type": "http.response.body", "body": b""})
            return
        if "GET" not in methods:             # HEAD where only POST is: the app's 405 with Allow
            await self.app(scope, receive, send)
            return

        async def without_body(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)
        await self.app({**scope, "method": "GET"}, receive, without_body)
