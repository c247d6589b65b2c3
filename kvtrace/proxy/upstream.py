"""The proxy's upstream side: HTTP/1.1 requests to one server over kept-alive connections, each
answer parsed by httptools (llhttp, the C parser uvicorn reads requests with).

A request is sent at most once. A kept-alive connection is reused only when a look at its socket
shows the upstream has neither closed it nor sent anything since its last answer, and a request
goes again, on another connection, only when not one of its bytes was taken by the first one:
once any byte left, a failure is the client's 502, never a second delivery of its POST.

Some servers end a chunked answer by closing the connection a moment later, without saying so in
the head (llama-server does after every stream). A request sent in that moment crosses the close on
the wire and cannot be answered, so once a connection is found closed after a chunked answer, the
upstream's connections are no longer kept after chunked answers.

A connection's time-out is the kernel's (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) on a blocking socket, set when
it changes: a socket with a Python time-out polls before every write and read, and every system call
lets the GIL go, a handoff to another thread when one waits. The idle connections are kept apart by
their time-out, so a request finds one set as it needs (the relay's none, the integrity calls' 30 s).

The upstream's answer is read as it arrives: its head within ``MAX_HEAD_BYTES`` (also the bound on
what may come between two pieces of body: a chunk's size line, the trailers), its body in the
pieces each read brings, never a whole chunk held back. What llhttp leaves to its caller is done
here: interim 1xx answers are skipped, a HEAD answer ends at its head, a body without a length
ends with the connection, and a connection that brought more than its answer is not reused.
"""

from __future__ import annotations

import re
import select
import socket
import ssl
import threading
import time
from typing import Iterator, Optional
from urllib.parse import urlsplit

import httptools

from kvtrace.errors import ConfigError
from kvtrace.proxy.http1 import READ_SIZE, Headers, kernel_timeout

CONNECT_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 << 10
"""An answer's head, or what is read between two pieces of its body (a chunk's size line, the
trailers): past this the answer is refused (502, or broken off once it began)."""
MAX_IDLE_CONNECTIONS = 64
"""Kept-alive connections held for reuse, whatever their time-out; past it the one idle longest is closed."""
MAX_IDLE_S = 2.0
"""A connection idle longer is not reused: servers close idle ones after a few seconds (llama-server's
HTTP library after 5), and a close that crosses the request on the wire would cost the client a 502."""

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")


class UpstreamUnreachable(Exception):
    """No connection to the upstream, or it closed before answering."""


class UpstreamBrokeOff(Exception):
    """The upstream's answer stopped before its end."""


class _NothingSent(Exception):
    """The connection took not one byte of the request."""


class _Malformed(Exception):
    """The upstream's bytes are not an answer the proxy relays."""


class _Stop(Exception):
    """Raised inside a parser callback to stop llhttp where the answer ends."""


def request_head(method: str, target: bytes, headers: Headers) -> bytes:
    """A request's head as written upstream; ``ValueError`` for a part that HTTP cannot carry."""
    if not _TOKEN.fullmatch(method.encode("latin-1")) or not _TARGET.fullmatch(target):
        raise ValueError(f"bad method or target: {method} {target!r}")
    lines = [b"%s %s HTTP/1.1" % (method.encode("latin-1"), target)]
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or b"\r" in value or b"\n" in value or b"\x00" in value:
            raise ValueError(f"bad header {name!r}")
        lines.append(name + b": " + value)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class _Answer:
    """One answer as llhttp calls it back: the head, the body's pieces since they were last taken,
    whether it ended, and whether the connection may carry another request after it."""

    def __init__(self, head_only: bool):
        self.parser = httptools.HttpResponseParser(self)
        self.head_only = head_only
        """An answer to HEAD: it has no body, whatever its head says."""
        self.status = 0
        self.headers: Headers = []
        self.head_done = False
        self.body: list[bytes] = []
        self.complete = False
        self.reusable = False
        """Its connection may carry another request (HTTP/1.1 keep-alive, framed by length or chunks)."""
        self.chunked = False
        """The body comes in chunks."""
        self.until_close = False
        """The body has neither a length nor chunks: it ends with the connection."""
        self.more = False
        """Bytes came after the answer's end."""
        self.waiting_bytes = 0
        """Bytes read since the last piece of body (or of the head): bounded by ``MAX_HEAD_BYTES``."""

    # --- llhttp's callbacks ---

    def on_message_begin(self) -> None:
        if self.complete:
            self.more = True  # the upstream sent more than it framed: never relayed
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # after the head: trailers, which are not relayed
            self.headers.append((name.lower(), value.strip()))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise _Malformed("the upstream switched protocols (101), which the proxy does not relay")
            self.headers = []  # an interim answer: the real one follows
            return
        size = 0
        framing: list[bytes] = []
        length = False
        for name, value in self.headers:  # one pass: an answer's head is read once
            size += len(name) + len(value) + 4
            if name == b"transfer-encoding":
                framing.append(value)
            elif name == b"content-length":
                length = True
        if size > MAX_HEAD_BYTES:
            raise _Malformed(f"the answer's head is over {MAX_HEAD_BYTES} bytes")
        if framing and (len(framing) > 1 or framing[0].lower() != b"chunked"):
            raise _Malformed("a transfer-encoding other than chunked")
        self.status = status
        self.head_done = True
        self.waiting_bytes = 0
        self.chunked = bool(framing)
        self.until_close = not framing and not length
        self.reusable = (self.parser.should_keep_alive() and self.parser.get_http_version() == "1.1"
                         and not self.until_close and not self.head_only)
        if self.head_only:
            self.complete = True
            raise _Stop  # llhttp would wait for the body its head announces

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.waiting_bytes = 0

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True

    # --- the reader's side ---

    def feed(self, data: bytes) -> None:
        """Parse what one read brought; ``_Malformed`` when it is not (the rest of) an answer."""
        self.waiting_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            cause = exc.__context__
            if isinstance(cause, _Malformed):
                raise cause from None
            if not isinstance(cause, _Stop):
                if not self.complete:
                    raise _Malformed(f"not an HTTP/1.1 answer: {exc}") from None
                self.more = True  # what followed the end is not an answer
        if self.waiting_bytes > MAX_HEAD_BYTES and not self.complete:
            raise _Malformed(f"over {MAX_HEAD_BYTES} bytes of " +
                             ("head" if not self.head_done else "framing between two pieces of the body"))

    def ended_by_close(self) -> None:
        """The upstream closed the connection: the answer's end if its body runs to the close."""
        if not self.head_done:
            raise _Malformed("the upstream closed the connection without answering")
        if not self.until_close:
            raise _Malformed("the upstream closed the connection before the answer's end")
        self.complete = True


class _Connection:
    def __init__(self, sock: socket.socket, timeout: Optional[float]):
        sock.settimeout(None)  # blocking: the time-out is the kernel's
        if timeout is not None:
            _set_kernel_timeout(sock, timeout)
        self.socket = sock
        self.timeout = timeout
        """Each socket operation's bound (``None``: none)."""
        self.idle_since = 0.0
        self.after_chunked = False
        """Its last answer was chunked."""
        self._poller = select.poll()
        """Registered once: the look before each reuse is one system call."""
        self._poller.register(sock, select.POLLIN)

    def alive(self) -> bool:
        """Idle and still open: nothing to read (neither the upstream's close nor stray bytes)."""
        try:
            if isinstance(self.socket, ssl.SSLSocket) and self.socket.pending():
                return False
            return not self._poller.poll(0)
        except (OSError, ValueError):
            return False

    def set_timeout(self, timeout: Optional[float]) -> None:
        """Each socket operation's bound, in the kernel: set only on a change (two system calls). A read
        or write past it fails with ``BlockingIOError`` (an ``OSError``), as one past a Python time-out
        failed with ``TimeoutError``."""
        if self.timeout != timeout:
            _set_kernel_timeout(self.socket, timeout)
            self.timeout = timeout

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

    def receive(self, answer: _Answer) -> None:
        """One read into ``answer``'s parser."""
        data = self.socket.recv(READ_SIZE)
        if data:
            answer.feed(data)
        else:
            answer.ended_by_close()

    def close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass


def _set_kernel_timeout(sock: socket.socket, timeout: Optional[float]) -> None:
    value = kernel_timeout(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class UpstreamResponse:
    """An answer whose body is read as it arrives; its connection goes back to the pool at the end."""

    def __init__(self, upstream: "Upstream", connection: _Connection, answer: _Answer):
        self._upstream = upstream
        self._connection = connection
        self._answer = answer
        self.status = answer.status
        self.headers: Headers = answer.headers
        """Names in lower case, values without the spaces around them."""
        self._done = False

    def header(self, name: bytes) -> str:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return ""

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives: what one read of the socket brought, framing removed."""
        answer, receive = self._answer, self._connection.receive
        pieces = answer.body
        broken = None
        while True:
            if pieces:
                yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
            if answer.complete:
                break
            try:
                receive(answer)
            except (OSError, _Malformed) as exc:
                broken = str(exc) or type(exc).__name__
                break
        if pieces:
            yield b"".join(pieces)  # what arrived before the break
        if broken is not None:
            raise UpstreamBrokeOff(broken)
        self._done = True
        self._upstream._release(self._connection, answer)

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
        self._idle: dict[Optional[float], list[_Connection]] = {}
        """Idle connections by their time-out, each list oldest first."""
        self._idle_count = 0
        self._json_heads: dict[str, bytes] = {}
        """:meth:`post_json`'s heads by target (a few fixed paths), up to the length's value: built once."""
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
            message = request_head(method, f"{self.prefix}{target}".encode("latin-1"),
                                   [(b"host", self.host_header), (b"content-length", b"%d" % len(body)),
                                    *headers]) + body
        except (ValueError, UnicodeEncodeError) as exc:
            raise UpstreamUnreachable(f"the request cannot be written to the upstream ({exc})") from None
        connection, answer = self._exchange(message, method == "HEAD", timeout)
        return UpstreamResponse(self, connection, answer)

    def post_json(self, target: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        """A small JSON POST (the integrity check's calls) and its whole answer: (status, body). The same
        request as :meth:`request` sends, its head built once per target; ``UpstreamUnreachable`` or
        ``UpstreamBrokeOff`` as there."""
        head = self._json_heads.get(target)
        if head is None:
            try:
                head = request_head("POST", f"{self.prefix}{target}".encode("latin-1"),
                                    [(b"host", self.host_header), (b"content-type", b"application/json")])
            except (ValueError, UnicodeEncodeError) as exc:
                raise UpstreamUnreachable(f"the request cannot be written to the upstream ({exc})") from None
            head = self._json_heads[target] = head[:-2] + b"content-length: "
        connection, answer = self._exchange(b"%b%d\r\n\r\n%b" % (head, len(body), body), False, timeout)
        try:
            while not answer.complete:
                connection.receive(answer)
        except (OSError, _Malformed) as exc:
            connection.close()
            raise UpstreamBrokeOff(str(exc) or type(exc).__name__) from None
        self._release(connection, answer)
        return answer.status, b"".join(answer.body)

    def _exchange(self, message: bytes, head_only: bool, timeout: Optional[float]) -> tuple[_Connection, _Answer]:
        """``message`` sent once, and its answer read up to the end of its head."""
        while True:
            connection = self._take(timeout)
            reused = connection is not None
            if connection is None:
                connection = self._connect(timeout)
            try:
                connection.set_timeout(timeout)
                connection.send(message)
            except _NothingSent as exc:
                connection.close()
                if reused:
                    continue  # not a byte of it left: the same request on another connection
                raise UpstreamUnreachable(str(exc)) from None
            except OSError as exc:
                connection.close()
                raise UpstreamUnreachable(f"the connection failed while the request was sent ({exc})") from None
            answer = _Answer(head_only=head_only)
            try:
                while not answer.head_done:
                    connection.receive(answer)
                return connection, answer
            except (OSError, _Malformed) as exc:
                connection.close()  # the request may have reached the upstream: it is not sent again
                if reused and connection.after_chunked:
                    self.closes_after_chunked = True
                raise UpstreamUnreachable(str(exc) or type(exc).__name__) from None

    def _take(self, timeout: Optional[float]) -> Optional[_Connection]:
        """The idle connection last left with ``timeout``, if any: one with another time-out is not taken, or
        requests that alternate (the relay's, the integrity calls') would set it again at each."""
        while True:
            with self._lock:
                same = self._idle.get(timeout)
                if not same:
                    return None
                connection = same.pop()
                self._idle_count -= 1
            if time.monotonic() - connection.idle_since < MAX_IDLE_S:
                if connection.alive():
                    return connection
                if connection.after_chunked:
                    self.closes_after_chunked = True
            connection.close()  # closed by the upstream while it waited, or soon to be

    def _connect(self, timeout: Optional[float]) -> _Connection:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
            return _Connection(sock, timeout)
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to {self.host}:{self.port} ({exc})") from None

    def _release(self, connection: _Connection, answer: _Answer) -> None:
        connection.after_chunked = answer.chunked
        if answer.chunked and self.closes_after_chunked:
            connection.close()
            return
        if not answer.reusable or answer.more:
            connection.close()  # the upstream asked to close, framed the answer by its end, or sent more
            return
        with self._lock:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(connection.timeout, []).append(connection)
            if self._idle_count < MAX_IDLE_CONNECTIONS:
                self._idle_count += 1
                return
            oldest = min((idle for idle in self._idle.values() if idle), key=lambda idle: idle[0].idle_since)
            connection = oldest.pop(0)
        connection.close()

    def close(self) -> None:
        with self._lock:
            for idle in self._idle.values():
                while idle:
                    idle.pop().close()
            self._idle_count = 0
