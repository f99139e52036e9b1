"""``--api-key``: a Bearer token on every path but /health."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse


def check_api_key(api_key: str) -> None:
    """An empty or blank key is refused: it must never read as "no authentication"."""
    if not isinstance(api_key, str) or not api_key.strip():
        raise ValueError("the API key is empty, which would turn authentication off; give a non-empty key")


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path but /health (pure ASGI: streaming and disconnects pass)."""

    def __init__(self, app, api_key: str):
        check_api_key(api_key)
        self.app = app
        self.expected = api_key.encode()

    def authorized(self, header: bytes) -> bool:
        """``Bearer KEY`` with the scheme in any case (RFC 7235: auth schemes are case-insensitive)."""
        scheme, _, given = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            if not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
                response = JSONResponse({"error": {"message": "missing or wrong API key: send the header "
                                                   "'Authorization: Bearer KEY' with the server's --api-key",
                                                   "type": "authentication_error", "code": 401}},
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
