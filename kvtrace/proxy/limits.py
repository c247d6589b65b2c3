"""What one client may take of ``kvtrace proxy``, and the defaults (docs/proxy-limits.md); what
shadow twins may take of the upstream (docs/proxy.md, "Shadow twins").

Kept apart from :mod:`http1` so that the command's options read the defaults without httptools
(the optional ``proxy`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Each limit has its refusal: a status, a counter of :mod:`kvtrace.recording.stats`, a closed connection."""

    max_header_bytes: int = 64 << 10
    """Request line and headers (431)."""
    max_body_bytes: int = 16 << 20
    """A request's body (413)."""
    max_connections: int = 256
    """Client connections open at once; one more is answered 503 and closed."""
    idle_timeout_s: float = 60.0
    """A kept-alive connection waits this long for its next request (then it is closed), and a write
    to the client (a streamed chunk, a whole answer) may take this long (then the client is cut off)."""
    request_timeout_s: float = 60.0
    """A request's head and body must arrive within this time of its first byte (408)."""


@dataclass(frozen=True)
class ShadowBudget:
    """``kvtrace proxy --shadow``: how many twins, and how much of the upstream they may take."""

    rate: float
    """The share of cache-hit requests that get a twin (0 < rate <= 1)."""
    in_flight: int = 1
    """Twins upstream at once."""
    tokens_per_minute: int = 20_000
    """Prompt plus generated tokens of the twins sent in a minute."""
    busy: int = 0
    """Twins only while at most this many other requests are upstream through the proxy (0: while it is idle)."""
