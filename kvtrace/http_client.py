"""kvtrace's own HTTP calls: the probe, alert delivery, the server experiment, the database's ``/ping``.
(The proxy relays on httptools instead, in kvtrace/proxy/.)

The standard library's ``http.client``, one connection per call: no dependency, a time-out for the
connect apart from the one for each wait on the answer (``/ping`` says which ran out), and redirects
never followed, so a POST is never repeated elsewhere with its ``Authorization`` header (alert
delivery counts a 3xx as a failed delivery). No ``HTTP_PROXY``: kvtrace calls the servers it is given.
JSON answers are decoded by kvtrace.json_decode, as the proxy decodes them.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit


class HttpStatusError(OSError):
    """The server answered with a status other than 2xx (a redirect too: it is not followed)."""

    def __init__(self, status: int, reason: str, body: bytes):
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body decoded; ``ValueError`` where it is not JSON."""
        # Deferred: kvtrace.db pings through this module in every traced process (recording's exporters
        # import it), where msgspec's 30-40 ms import would be paid for nothing.
        from kvtrace.json_decode import loads

        return loads(self.body)

    def raise_for_status(self) -> "Answer":
        if not 200 <= self.status < 300:
            raise HttpStatusError(self.status, self.reason, self.body)
        return self


def request(method: str, url: str, json_body: Any = None, headers: Optional[Mapping[str, str]] = None,
            timeout_s: Optional[float] = 30.0, connect_timeout_s: Optional[float] = None) -> Answer:
    """One request on a connection of its own, its whole answer read, whatever its status.

    ``connect_timeout_s`` bounds the connect (default ``timeout_s``), ``timeout_s`` each wait on the
    answer (``None``: no bound). ``json_body`` is sent as JSON. A failure to connect, a time-out
    (``TimeoutError``) or an answer that is not HTTP raise ``OSError``; a URL that is not http(s)
    raises ``ValueError``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host URL")
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port,
                                  timeout=timeout_s if connect_timeout_s is None else connect_timeout_s)
    sent_headers = dict(headers or {})
    body = None
    if json_body is not None:
        body = json.dumps(json_body).encode()
        sent_headers.setdefault("Content-Type", "application/json")
    try:
        connection.connect()
        connection.sock.settimeout(timeout_s)
        connection.request(method, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body,
                           sent_headers)
        response = connection.getresponse()
        return Answer(response.status, response.reason, response.read())
    except http.client.HTTPException as exc:  # a malformed or cut-off answer: one kind of failure, OSError
        raise ConnectionError(f"no HTTP answer ({type(exc).__name__}: {exc})") from None
    finally:
        connection.close()


def get_json(url: str, timeout_s: Optional[float] = 30.0, headers: Optional[Mapping[str, str]] = None) -> Any:
    """``GET url``'s JSON; ``HttpStatusError`` unless it answers 2xx, ``ValueError`` if not JSON."""
    return request("GET", url, headers=headers, timeout_s=timeout_s).raise_for_status().json()


def post_json(url: str, payload: Any, timeout_s: Optional[float] = 30.0,
              headers: Optional[Mapping[str, str]] = None) -> Any:
    """``POST url`` with ``payload`` as JSON; the answer's JSON, raising as :func:`get_json` does."""
    return request("POST", url, payload, headers, timeout_s).raise_for_status().json()
