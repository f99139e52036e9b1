"""The HTTP layer under the app: uvicorn's h11 protocol with connection bounds, the open-file limit,
and the uvicorn configuration ``serve`` and the tests run."""
from __future__ import annotations

import json
import logging
import math
import time

from .limits import ServerLimits

log = logging.getLogger("moetailor.server")


class _OnceLog:
    """A warning logged once per ``every`` seconds however often it happens (a flood of refused
    connections must not fill the log)."""

    def __init__(self, every: float = 60.0):
        self.every, self.last, self.count = every, -math.inf, 0

    def __call__(self, message: str, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.warning(message + " (%d times so far; logged at most once a minute)", *args, self.count)


def http_protocol(limits: ServerLimits):
    """uvicorn's h11 protocol with the connection bounds of ``limits``: a connection that sends nothing
    for ``idle_timeout_s`` (before its first request or after a response) or has not completed a request
    head ``header_timeout_s`` after its first byte is closed; above ``max_connections`` open connections
    a new one is answered 503 and closed at once (logged once a minute), so idle sockets can never use
    up the process's file descriptors."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    shed = _OnceLog()
    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n")
    message = json.dumps({"error": {"message": f"too many open connections (--max-connections "
                                               f"{limits.max_connections}); retry later",
                                    "type": "server_unavailable", "code": 503}}).encode()

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self._deadline, self._awaiting_head, self._shed = None, True, False
            if len(self.connections) >= limits.max_connections:
                self._shed = True
                shed("shedding load: %d connections open (--max-connections %d); new ones get 503",
                     len(self.connections), limits.max_connections)
                transport.write(busy % len(message) + message)
                transport.close()
                self.transport = transport
                return
            super().connection_made(transport)
            self._arm(limits.idle_timeout_s)

        def _arm(self, seconds: float | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expired) if seconds else None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _receive(self, data: bytes) -> None:
            if self._awaiting_head and not self._in_request():
                self._awaiting_head = False        # the first byte of a request head: its deadline starts
                self._arm(limits.header_timeout_s)
            super().data_received(data)
            if self._in_request():
                self._arm(None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_request():                 # a pipelined request already started
                self._arm(None)
            elif not self.transport.is_closing():
                self._awaiting_head = True
                self._arm(limits.idle_timeout_s)

        def data_received(self, data: bytes) -> None:   # a shed connection reads nothing
            if not self._shed:
                self._receive(data)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if not self._shed:
                super().connection_lost(exc)

    return BoundedH11Protocol


def raise_fd_limit(limits: ServerLimits) -> None:
    """Lift the soft open-file limit to the hard one and keep --max-connections below it."""
    try:
        import resource
    except ImportError:   # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if limits.max_connections > soft - 256:
        log.warning("--max-connections %d is near the open-file limit %d: using %d", limits.max_connections, soft,
                    max(16, soft - 256))
        limits.max_connections = max(16, soft - 256)


def server_config(app, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
                  log_level: str = "info"):
    """The uvicorn configuration ``serve`` runs ``app`` with (tests start the same one)."""
    import uvicorn

    limits = limits or ServerLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http_protocol(limits),
                          timeout_keep_alive=math.ceil(limits.idle_timeout_s),
                          timeout_graceful_shutdown=math.ceil(limits.shutdown_timeout_s))
