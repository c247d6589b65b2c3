"""The proxy's client-facing HTTP/1.1: blocking sockets, one thread per client connection, requests
parsed by httptools (llhttp, the parser uvicorn reads requests with; h11 cost about 75 µs a request
here, llhttp 3), answers framed here as h11 framed them.

Why not an ASGI server or asyncio: on the machines measured, an event loop's own work per wake-up
cost several times what a thread that blocks on ``recv`` and calls ``send`` costs per relayed
chunk (``benchmarks/proxy_overhead.py``). A proxy in front of an inference server has few
connections and long streams, which threads serve well. A whole answer goes back in one write
(head and body together); a streamed answer's head goes with its first chunk.

A client's socket stays blocking, its time-outs set in the kernel (``SO_RCVTIMEO``,
``SO_SNDTIMEO``) and changed only when they change: a socket with a Python time-out polls before
every read and write, and every system call lets the GIL go, which, with a thread per connection,
wakes another thread for nothing. A relayed request is one read and one write on the client's side.

Every client is held to :class:`Limits` (head and body sizes, connections, time-outs; see
docs/proxy-limits.md): a request over one is refused with its status (400, 408, 413, 431, 503)
and counted, and its connection closed. The upstream side is :mod:`upstream`.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable, Optional
from urllib.parse import unquote

import httptools

from kvtrace.proxy.limits import Limits
from kvtrace.recording.stats import (PROXY_ACCEPT_ERRORS, PROXY_BAD_REQUESTS, PROXY_CLIENT_TIMEOUTS,
                                     PROXY_REFUSED_BODY, PROXY_REFUSED_BUSY, PROXY_REFUSED_HEADERS)

log = logging.getLogger("kvtrace.proxy")

READ_SIZE = 65536
Headers = list[tuple[bytes, bytes]]

ACCEPT_BACKOFF_S = (0.01, 1.0)
"""First and longest pause after ``accept`` failed (descriptors or memory exhausted): doubled each time."""
LINGER_S = 2.0
"""How long a refused connection is read (and the bytes dropped) before it closes, so that the
client reads its refusal instead of a reset; at most ``LINGER_BYTES``."""
LINGER_BYTES = 1 << 20
BUSY_LINGER_S = 0.1
"""The same for a 503 written by the accepting thread, which must go back to accepting."""
RETRY = [(b"retry-after", b"1")]
_TIMEVAL = struct.Struct("@ll")
"""``struct timeval`` (seconds, microseconds), as ``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` take it."""


class ClientGone(Exception):
    """The client closed its connection, or stopped reading, while its answer was being written."""


class _Refused(Exception):
    """A request the proxy does not serve: answered with ``status`` and counted as ``counter``."""

    def __init__(self, status: int, counter: str, message: str):
        super().__init__(message)
        self.status = status
        self.counter = counter


@dataclass
class Request:
    method: str
    target: str
    """Path and query, as the client sent them (origin form, without dot-segments)."""
    path: str
    headers: Headers
    body: bytes


class Responder:
    """Writes one response. The head waits for the first body bytes so both leave in one write, and
    until then a later :meth:`start` replaces it (an error instead of an answer that never came).

    The body's framing is chosen as h11 chose it: the given ``content-length`` (a body that does not
    fit it cannot be completed truthfully: ``ClientGone``), else chunks to an HTTP/1.1 client and the
    connection's close to an HTTP/1.0 one; none for an answer to HEAD, 204 and 304."""

    def __init__(self, sock: socket.socket, head_only: bool = False, keep_alive: bool = True,
                 chunks_allowed: bool = True, write_timeout_s: float = 60.0):
        self._socket = sock
        self._write_timeout_s = write_timeout_s
        """How long one write may take to go out (the socket's ``SO_SNDTIMEO`` bounds each send)."""
        self._head_only = head_only
        self._chunks_allowed = chunks_allowed
        self.keep_alive = keep_alive
        """The connection may carry the client's next request once this answer is finished."""
        self._head: Optional[bytes] = None
        self._framing = _LENGTH
        self._remaining = 0
        self.started = False
        """A head was given."""
        self.committed = False
        """Bytes of the answer went to the client."""
        self.finished = False

    @property
    def client_gone(self) -> bool:
        """Whether the client closed its end (a look at the socket, nothing read).

        Asked of poll first: a socket with a time-out waits for data even when told not to."""
        try:
            poller = select.poll()
            poller.register(self._socket, select.POLLIN)
            ready = poller.poll(0)
            if not ready:
                return False
            if ready[0][1] & (select.POLLERR | select.POLLNVAL):
                return True
            return self._socket.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def start(self, status: int, headers: Headers) -> None:
        out: Headers = []
        declared = None
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                if declared is None:
                    declared = value
            elif lower in (b"transfer-encoding", b"connection"):
                continue  # the framing is the proxy's own
            out.append((name, value))
        if self._head_only or status in (204, 304) or status < 200:
            self._framing, self._remaining = _LENGTH, 0
            if status in (204, 304) or status < 200:
                out = [(name, value) for name, value in out if name.lower() != b"content-length"]
        elif declared is not None:
            self._framing, self._remaining = _LENGTH, int(declared)
        elif self._chunks_allowed:
            self._framing = _CHUNKED
            out.append((b"transfer-encoding", b"chunked"))
        else:
            self._framing = _CLOSE
            self.keep_alive = False
        if not self.keep_alive:
            out.append((b"connection", b"close"))
        self._head = _response_head(status, out)
        self.started = True

    def send(self, data: bytes) -> None:
        if data:
            self._write(self._frame(data))

    def end(self, data: bytes = b"") -> None:
        out = self._frame(data)
        if self._framing is _CHUNKED:
            out += b"0\r\n\r\n"
        elif self._framing is _LENGTH and self._remaining:
            self._fail(f"{self._remaining} bytes short of its content-length")
        if out:  # an answer whose last bytes went already ends without another write
            self._write(out)
        self.finished = True

    def _frame(self, data: bytes) -> bytes:
        head, self._head = (self._head or b""), None
        if self._head_only or not data:
            return head
        if self._framing is _CHUNKED:
            return head + b"%x\r\n" % len(data) + data + b"\r\n"
        if self._framing is _LENGTH:
            if len(data) > self._remaining:
                self._fail("over its content-length")
            self._remaining -= len(data)
        return head + data

    def _fail(self, why: str) -> None:
        # The upstream's body does not fit the length its head declared: the client's answer
        # cannot be completed truthfully, so its connection ends here.
        self.keep_alive = False
        raise ClientGone(f"the answer cannot be framed: its body is {why}")

    def _write(self, out: bytes) -> None:
        self.committed = True
        started = time.monotonic()
        try:
            sent = self._socket.send(out)  # the whole of it, unless the time-out or a signal ended the send
            if sent < len(out):
                self._write_rest(memoryview(out)[sent:], started + self._write_timeout_s)
        except OSError as exc:  # a time-out included (EAGAIN): a client that stopped reading
            raise ClientGone(str(exc) or type(exc).__name__) from None

    def _write_rest(self, rest: memoryview, deadline: float) -> None:
        # A send that stopped short waited ``SO_SNDTIMEO`` already, or was interrupted: what is left
        # goes out within the same bound, so that a client reading a trickle is cut off too.
        while rest:
            if time.monotonic() >= deadline:
                raise ClientGone(f"the answer did not go out within {self._write_timeout_s:g} s")
            rest = rest[self._socket.send(rest):]


_LENGTH, _CHUNKED, _CLOSE = "length", "chunked", "close"


_REASONS = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}
"""Each status's reason phrase (looked up here: building an ``HTTPStatus`` costs more than the rest of the head)."""


def _response_head(status: int, headers: Headers) -> bytes:
    reason = _REASONS.get(status, b"")
    return b"HTTP/1.1 %d %s\r\n" % (status, reason) + b"".join(
        name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n"


Handler = Callable[[Request, Responder], None]
Counter = Callable[[str], None]


class _Client:
    """One client connection and whether a request of it is being answered."""

    def __init__(self, sock: socket.socket):
        self.socket = sock
        self.busy = False
        self.thread: Optional[threading.Thread] = None


class Server:
    """A listening socket and a thread per client connection, within ``limits``.

    ``count(name)`` is called once per refusal or accept failure, with a counter name of
    :mod:`kvtrace.recording.stats`. :meth:`stop` stops accepting, lets the requests being answered
    finish (their records with them) for up to ``grace_s`` seconds, and closes the connections that
    wait for a next request.
    """

    def __init__(self, handler: Handler, host: str, port: int, limits: Limits = Limits(),
                 count: Counter = lambda name: None, reuse_port: bool = False):
        self._handler = handler
        self._limits = limits
        self._count = count
        # reuse_port: the workers of one proxy listen on the same port, the kernel spreading connections.
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=reuse_port)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="kvtrace-proxy-accept", daemon=True)
        self._clients: set[_Client] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self) -> "Server":
        self._thread.start()
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(10)
        deadline = time.monotonic() + grace_s
        while True:
            with self._lock:
                clients = list(self._clients)
            for client in clients:
                if not client.busy:
                    _shut(client.socket)  # waiting for a next request that will not be served
            busy = [c for c in clients if c.busy]
            if not busy or time.monotonic() > deadline:
                break
            busy[0].thread.join(min(0.05, max(0.0, deadline - time.monotonic())))
        for client in clients:
            _shut(client.socket)

    def _accept(self) -> None:
        pause = ACCEPT_BACKOFF_S[0]
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                if exc.errno != errno.ECONNABORTED:  # aborted: the client gave up before it was accepted
                    pause = self._back_off(exc, pause)
                continue
            try:
                self._admit(sock)
                pause = ACCEPT_BACKOFF_S[0]
            except Exception as exc:  # noqa: BLE001 - the accepting thread must outlive every failure
                sock.close()
                pause = self._back_off(exc, pause)

    def _back_off(self, exc: Exception, pause: float) -> float:
        # Out of descriptors (EMFILE), memory or threads: a connection waits in the backlog until
        # something is freed, and the proxy goes on accepting after a pause.
        self._count(PROXY_ACCEPT_ERRORS)
        log.warning("kvtrace proxy: accepting a connection failed (%s); trying again in %g s", exc, pause)
        self._stopping.wait(pause)
        return min(pause * 2, ACCEPT_BACKOFF_S[1])

    def _admit(self, sock: socket.socket) -> None:
        client = _Client(sock)
        client.thread = threading.Thread(target=self._serve, args=(client,), name="kvtrace-proxy-connection",
                                         daemon=True)
        with self._lock:
            full = len(self._clients) >= self._limits.max_connections
            if not full:
                self._clients.add(client)
        if full:
            self._count(PROXY_REFUSED_BUSY)
            _refuse(sock, 503, "kvtrace proxy: too many connections; try again shortly", BUSY_LINGER_S, RETRY)
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.thread.start()
        except BaseException:
            with self._lock:
                self._clients.discard(client)
            _refuse(sock, 503, "kvtrace proxy: no thread to serve this connection; try again shortly",
                    BUSY_LINGER_S, RETRY)
            raise

    def _serve(self, client: _Client) -> None:
        try:
            _serve_connection(self._handler, client, self._limits, self._count, self._stopping.is_set)
        except (OSError, ClientGone):
            pass
        except Exception:
            # Not one request's failure to pass on: the connection is closed, the proxy goes on.
            log.exception("kvtrace proxy: a client connection failed")
        finally:
            client.busy = False
            with self._lock:
                self._clients.discard(client)
            client.socket.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _serve_connection(handler: Handler, client: _Client, limits: Limits, count: Counter,
                      stopping: Callable[[], bool]) -> None:
    sock = client.socket
    sock.settimeout(None)  # blocking, bounded by the kernel's time-outs: a client that stops reading is cut off
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, kernel_timeout(limits.idle_timeout_s))
    reader = _Reader(sock, limits)
    while not stopping():
        try:
            parsed = reader.next_request()
        except _Refused as refused:
            count(refused.counter)
            _refuse(sock, refused.status, str(refused), LINGER_S)
            return
        if parsed is None:
            return  # the client closed the connection, or left it idle too long
        request, keep_alive, http11 = parsed
        client.busy = True
        responder = Responder(sock, head_only=request.method == "HEAD", keep_alive=keep_alive, chunks_allowed=http11,
                              write_timeout_s=limits.idle_timeout_s)
        try:
            handler(request, responder)
        finally:
            client.busy = False
        if not responder.finished or not responder.keep_alive:
            return  # the response was cut short, or one side asked to close: the connection ends here


class _Stop(Exception):
    """Raised inside a parser callback to stop llhttp at a request's end."""


class _Requests:
    """One connection's requests as llhttp (httptools) calls them back, each held to ``limits``."""

    def __init__(self, limits: Limits):
        self.parser = httptools.HttpRequestParser(self)
        self.limits = limits
        self.ready: deque[tuple[Request, bool, bool]] = deque()
        """Whole requests not yet served, with whether the client keeps the connection and speaks HTTP/1.1."""
        self.in_request = False
        """A request has begun and is not whole yet."""
        self.refused: Optional[_Refused] = None
        """Why the connection's next request is refused (after those before it are served)."""
        self.ended = False
        """No request after those ready is read (one asked to switch protocols)."""
        self._new_request()

    def _new_request(self) -> None:
        self.url = b""
        self.headers: Headers = []
        self.head_bytes = 0
        self.head_done = False
        self.body = bytearray()
        self.wants_continue = False

    # --- llhttp's callbacks ---

    def on_message_begin(self) -> None:
        self.in_request = True
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # after the head: a chunked body's trailers, not relayed
            self.headers.append((name.lower(), value.strip()))

    def on_headers_complete(self) -> None:
        self.head_done = True
        limits = self.limits
        size = len(self.parser.get_method()) + len(self.url)
        host = self.wants_continue = False
        declared = None
        for name, value in self.headers:  # one pass: a request's head is read once
            size += len(name) + len(value) + 4
            if name == b"host":
                host = True
            elif name == b"content-length":
                if declared is None:
                    declared = value
            elif name == b"expect" and value.lower() == b"100-continue":
                self.wants_continue = True
        if size > limits.max_header_bytes:
            raise _head_too_large(limits)
        problem = target_problem(self.url.decode("latin-1"))
        if problem:
            raise _Refused(400, PROXY_BAD_REQUESTS, f"kvtrace proxy: {problem}")
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise _Refused(400, PROXY_BAD_REQUESTS, f"kvtrace proxy: bad request: HTTP/{version} is not served")
        if version == "1.1" and not host:
            raise _Refused(400, PROXY_BAD_REQUESTS, "kvtrace proxy: bad request: an HTTP/1.1 request needs a Host")
        if declared is not None and int(declared) > limits.max_body_bytes:
            raise _body_too_large(limits)

    def on_body(self, body: bytes) -> None:
        self.body += body
        self.wants_continue = False
        if len(self.body) > self.limits.max_body_bytes:  # a chunked body has no length to check first
            raise _body_too_large(self.limits)

    def on_message_complete(self) -> None:
        parser = self.parser
        target = self.url.decode("latin-1")
        request = Request(parser.get_method().decode("ascii"), target, target.split("?", 1)[0], self.headers,
                          bytes(self.body))
        self.ready.append((request, parser.should_keep_alive(), parser.get_http_version() == "1.1"))
        self.in_request = False
        self._new_request()

    # --- the reader's side ---

    def feed(self, data: bytes) -> None:
        """Parse what one read brought; a refusal is kept in ``refused`` (after the requests before it)."""
        self.head_bytes += len(data)  # a head that began in this read is counted from the next one
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self.refused = cause
            elif isinstance(exc, httptools.HttpParserUpgrade) and self.ready:
                # The request asked to switch protocols, which the proxy does not: it is answered as it
                # is, and the connection ends after it.
                request, _, http11 = self.ready.pop()
                self.ready.append((request, False, http11))
                self.ended = True
            else:
                self.refused = _Refused(400, PROXY_BAD_REQUESTS, f"kvtrace proxy: bad request: {exc}")
            return
        if self.in_request and not self.head_done and self.head_bytes > self.limits.max_header_bytes:
            self.refused = _head_too_large(self.limits)


class _Reader:
    """A connection's requests, each read within the time-outs: a connection may idle for
    ``idle_timeout_s`` before a request's first byte, and the request must arrive within
    ``request_timeout_s`` of it."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self._socket, self._limits = sock, limits
        self._requests = _Requests(limits)
        self._receive_timeout_s: Optional[float] = None
        """The socket's ``SO_RCVTIMEO`` as last set (``None``: not set by the reader yet)."""

    def next_request(self) -> Optional[tuple[Request, bool, bool]]:
        """The next whole request, with whether the client keeps the connection and speaks HTTP/1.1;
        ``None`` when the client closed or idled; ``_Refused`` for a bad or late one."""
        requests, limits = self._requests, self._limits
        started = requests.in_request  # a pipelined request may be there already
        deadline = time.monotonic() + (limits.request_timeout_s if started else limits.idle_timeout_s)
        continued = False
        while not requests.ready:
            if requests.ended:
                return None
            if requests.refused is not None:
                raise requests.refused
            if requests.wants_continue and not continued:
                continued = True
                self._socket.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                # Waiting for a request's first byte, the time-out is the idle one, as it was for the
                # request before: the kernel's time-out is changed only within a request read in pieces.
                wait_s = deadline - time.monotonic() if started else limits.idle_timeout_s
                if wait_s <= 0:
                    raise TimeoutError
                if wait_s != self._receive_timeout_s:
                    self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, kernel_timeout(wait_s))
                    self._receive_timeout_s = wait_s
                data = self._socket.recv(READ_SIZE)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO passed (EAGAIN)
                if not started:
                    return None  # idle: closed without a word, as a kept-alive connection may be
                raise _Refused(408, PROXY_CLIENT_TIMEOUTS, f"kvtrace proxy: the request did not arrive within "
                               f"{limits.request_timeout_s:g} s") from None
            if not data:
                return None  # the client closed the connection (in the middle of its request, perhaps)
            if not started:
                started = True
                deadline = time.monotonic() + limits.request_timeout_s
            requests.feed(data)
        return requests.ready.popleft()


def kernel_timeout(seconds: Optional[float]) -> bytes:
    """``seconds`` as ``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` take it; ``None``: none (zero), else never zero."""
    if seconds is None:
        return _TIMEVAL.pack(0, 0)
    whole = int(min(seconds, 1 << 31))
    return _TIMEVAL.pack(whole, max(int((seconds - whole) * 1e6), 0 if whole else 1))


def _head_too_large(limits: Limits) -> _Refused:
    return _Refused(431, PROXY_REFUSED_HEADERS, f"kvtrace proxy: the request's head is over "
                    f"{limits.max_header_bytes} bytes")


def _body_too_large(limits: Limits) -> _Refused:
    return _Refused(413, PROXY_REFUSED_BODY, f"kvtrace proxy: the request's body is over {limits.max_body_bytes} bytes")


def target_problem(target: str) -> Optional[str]:
    """Why a request target is not served (``None``: it is): only origin form (``/path?query``),
    and no ``.`` or ``..`` segment, written plainly or percent-encoded, that could climb out of the
    upstream's prefix."""
    if not target.startswith("/"):
        return "only a path (origin form, starting with /) is served as the request target"
    if "#" in target:
        return "a request target has no fragment (#)"
    path = target.split("?", 1)[0]
    if "." not in path and "%" not in path:
        return None  # no segment can spell a dot, plainly or percent-encoded
    for segment in path.split("/"):
        if unquote(segment) in (".", ".."):
            return "the request path has a dot-segment (. or ..)"
    return None


def _refuse(sock: socket.socket, status: int, message: str, linger_s: float,
            headers: Optional[Headers] = None) -> None:
    """Answer ``status`` with a one-line body and close, after reading what the client still sends
    (for at most ``linger_s``), so that it reads the answer instead of a reset."""
    body = message.encode("utf-8")
    out = _response_head(status, [(b"content-type", b"text/plain; charset=utf-8"),
                                  (b"content-length", b"%d" % len(body)), (b"connection", b"close"),
                                  *(headers or [])]) + body
    try:
        sock.settimeout(linger_s)
        sock.sendall(out)
        sock.shutdown(socket.SHUT_WR)
        _drain(sock, linger_s)
    except OSError:
        pass
    finally:
        sock.close()


def _drain(sock: socket.socket, linger_s: float) -> None:
    deadline = time.monotonic() + linger_s
    dropped = 0
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while dropped < LINGER_BYTES:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            return
        data = sock.recv(READ_SIZE)
        if not data:
            return
        dropped += len(data)
