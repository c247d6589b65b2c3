"""The proxy's upstream side: HTTP/1.1 requests to one server over kept-alive connections, on h11's
client mode (the same state machine as the client-facing side, :mod:`http1`).

A request is sent at most once. A kept-alive connection is reused only when a look at its socket
shows the upstream has neither closed it nor sent anything since its last answer, and a request
goes again, on another connection, only when not one of its bytes was taken by the first one:
once any byte left, a failure is the client's 502, never a second delivery of its POST.

Some servers end a chunked answer by closing the connection a moment later, without saying so in
the head (llama-server does after every stream). A request sent in that moment crosses the close on
the wire and cannot be answered, so once a connection is found closed after a chunked answer, the
upstream's connections are no longer kept after chunked answers.

The upstream's answer is read as it arrives: its head within ``MAX_HEAD_BYTES`` (also the bound on
a chunk's size line and on trailers), its body in the pieces each read brings, never a whole chunk
held back.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from typing import Iterator, Optional
from urllib.parse import urlsplit

import h11

from kvtrace.errors import ConfigError
from kvtrace.proxy.http1 import READ_SIZE, Headers

CONNECT_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 << 10
"""An answer's head, a chunk's size line, the trailers: past this the answer is refused (502)."""
MAX_IDLE_CONNECTIONS = 64
"""Kept-alive connections held for reuse; more are closed when their answer ends."""
MAX_IDLE_S = 2.0
"""A connection idle longer is not reused: servers close idle ones after a few seconds (llama-server's
HTTP library after 5), and a close that crosses the request on the wire would cost the client a 502."""


class UpstreamUnreachable(Exception):
    """No connection to the upstream, or it closed before answering."""


class UpstreamBrokeOff(Exception):
    """The upstream's answer stopped before its end."""


class _NothingSent(Exception):
    """The connection took not one byte of the request."""


class _Connection:
    def __init__(self, sock: socket.socket):
        self.socket = sock
        self.protocol = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0
        self.after_chunked = False
        """Its last answer was chunked."""

    def alive(self) -> bool:
        """Idle and still open: nothing to read (neither the upstream's close nor stray bytes)."""
        try:
            if isinstance(self.socket, ssl.SSLSocket) and self.socket.pending():
                return False
            poller = select.poll()
            poller.register(self.socket, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def send(self, message: bytes) -> None:
        """All of ``message``; ``_NothingSent`` when the first write failed (nothing left)."""
        view = memoryview(message)
        sent = 0
        while sent < len(view):
            try:
                sent += self.socket.send(view[sent:])
            except OSError as exc:
                if sent == 0:
                    raise _NothingSent(str(exc) or type(exc).__name__) from None
                raise

    def receive(self) -> None:
        self.protocol.receive_data(self.socket.recv(READ_SIZE))

    def close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass


class UpstreamResponse:
    """An answer whose body is read as it arrives; its connection goes back to the pool at the end."""

    def __init__(self, upstream: "Upstream", connection: _Connection, response: h11.Response):
        self._upstream = upstream
        self._connection = connection
        self.status = response.status_code
        self.headers: Headers = list(response.headers)
        self._done = False
        self._chunked = "chunked" in self.header(b"transfer-encoding").lower()

    def header(self, name: bytes) -> str:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return ""

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives: what one read of the socket brought, framing removed."""
        protocol = self._connection.protocol
        pieces: list[bytes] = []
        broken = None
        while True:
            try:
                event = protocol.next_event()
                if type(event) is h11.Data:
                    pieces.append(event.data)
                    continue
                if type(event) is h11.EndOfMessage:
                    break
                if event is not h11.NEED_DATA:
                    raise OSError(f"unexpected {type(event).__name__}")
            except (OSError, h11.RemoteProtocolError) as exc:
                broken = str(exc) or type(exc).__name__
                break
            if pieces:
                yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
            try:
                self._connection.receive()
            except OSError as exc:
                broken = str(exc) or type(exc).__name__
                break
        if pieces:
            yield b"".join(pieces)  # what arrived before the end, or before the break
        if broken is not None:
            raise UpstreamBrokeOff(broken)
        self._done = True
        self._upstream._release(self._connection, self._chunked)

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def close(self) -> None:
        """Give up on the rest of the answer (its connection cannot be reused)."""
        if not self._done:
            self._done = True
            self._connection.close()


class Upstream:
    """Requests to one server (``http(s)://host:port[/prefix]``), over connections kept alive between requests."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        if parts.username is not None or parts.password is not None:
            raise ConfigError("the upstream URL must not hold credentials (user:password@): the proxy would "
                              "show them in its errors and spans")
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default_port = self.port == (443 if self.tls else 80)
        self.host_header = (self.host if default_port else f"{self.host}:{self.port}").encode("idna")
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self.closes_after_chunked = False
        """A connection was found closed after a chunked answer: such connections are not kept."""

    def request(self, method: str, target: str, headers: Headers, body: bytes,
                timeout: Optional[float] = None) -> UpstreamResponse:
        """Send a request; returns once the answer's head arrived (``UpstreamUnreachable`` if it does not).

        ``target`` is an origin-form path (``http1`` refuses any other). ``timeout`` bounds each
        socket operation of this request (``None``: a generation takes as long as it takes, as it
        would without the proxy).
        """
        try:
            head = h11.Request(method=method, target=f"{self.prefix}{target}".encode("latin-1"),
                               headers=[(b"host", self.host_header), (b"content-length", b"%d" % len(body)),
                                        *headers])
        except h11.LocalProtocolError as exc:
            raise UpstreamUnreachable(f"the request cannot be written to the upstream ({exc})") from None
        while True:
            connection = self._take()
            reused = connection is not None
            if connection is None:
                connection = self._connect()
            connection.socket.settimeout(timeout)
            protocol = connection.protocol
            message = protocol.send(head) + (protocol.send(h11.Data(data=body)) if body else b"") + protocol.send(
                h11.EndOfMessage())
            try:
                connection.send(message)
            except _NothingSent as exc:
                connection.close()
                if reused:
                    continue  # not a byte of it left: the same request on another connection
                raise UpstreamUnreachable(str(exc)) from None
            except OSError as exc:
                connection.close()
                raise UpstreamUnreachable(f"the connection failed while the request was sent ({exc})") from None
            try:
                return UpstreamResponse(self, connection, self._read_head(connection))
            except (OSError, h11.RemoteProtocolError) as exc:
                connection.close()  # the request may have reached the upstream: it is not sent again
                if reused and connection.after_chunked:
                    self.closes_after_chunked = True
                raise UpstreamUnreachable(str(exc) or type(exc).__name__) from None

    @staticmethod
    def _read_head(connection: _Connection) -> h11.Response:
        protocol = connection.protocol
        while True:
            event = protocol.next_event()
            if event is h11.NEED_DATA:
                connection.receive()
            elif type(event) is h11.Response:
                # h11 bounds a head that is still arriving; one that came whole in a read is counted here.
                if sum(len(name) + len(value) + 4 for name, value in event.headers) > MAX_HEAD_BYTES:
                    raise OSError(f"the answer's head is over {MAX_HEAD_BYTES} bytes")
                return event
            elif type(event) is not h11.InformationalResponse:  # 1xx answers are interim: the real one follows
                raise OSError("the upstream closed the connection without answering")

    def _take(self) -> Optional[_Connection]:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
            if time.monotonic() - connection.idle_since < MAX_IDLE_S:
                if connection.alive():
                    return connection
                if connection.after_chunked:
                    self.closes_after_chunked = True
            connection.close()  # closed by the upstream while it waited, or soon to be

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to {self.host}:{self.port} ({exc})") from None
        return _Connection(sock)

    def _release(self, connection: _Connection, chunked: bool) -> None:
        protocol = connection.protocol
        connection.after_chunked = chunked
        if chunked and self.closes_after_chunked:
            connection.close()
            return
        if protocol.our_state is h11.DONE and protocol.their_state is h11.DONE and not protocol.trailing_data[0]:
            protocol.start_next_cycle()
            with self._lock:
                if len(self._idle) < MAX_IDLE_CONNECTIONS:
                    connection.idle_since = time.monotonic()
                    self._idle.append(connection)
                    return
        connection.close()  # the upstream asked to close, framed the answer by its end, or sent more

    def close(self) -> None:
        with self._lock:
            while self._idle:
                self._idle.pop().close()
