"""What one request and one connection may ask for: the ``moetailor serve`` flags of the same names,
checked once when the server starts."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ServerLimits:
    """What one request may ask for (``moetailor serve`` flags of the same names)."""
    max_request_bytes: int = 8 * 2**20     # the HTTP body
    max_prompt_chars: int | None = None    # characters of a text prompt (chat: all messages), checked before
                                           # tokenizing; None = 32 x the context length in tokens
    max_stop_strings: int = 16
    max_stop_chars: int = 256              # per stop string
    max_messages: int = 4096               # chat messages per request
    max_detokenize_ids: int | None = None  # token ids per /detokenize request; None = 32 x the context length
    max_connections: int = 1024            # open HTTP connections; more are answered 503 and closed
    idle_timeout_s: float = 5.0            # a connection that sends nothing for this long is closed
    header_timeout_s: float = 10.0         # ... and one whose request head is not complete by then
    body_timeout_s: float = 30.0           # a request whose body is not complete this long after its head: 408
    shutdown_timeout_s: float = 30.0       # SIGTERM: requests in flight get this long to finish

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_chars", "max_stop_strings", "max_stop_chars", "max_messages",
                     "max_detokenize_ids", "max_connections"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} {value!r} must be an integer >= 1")
        for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} {value!r} must be a positive number "
                                 "of seconds")
