"""The proxy's client-facing HTTP/1.1: blocking sockets, one thread per client connection, and h11
(the protocol state machine httpx and uvicorn use themselves) for parsing and framing.

Why not an ASGI server or asyncio: on the machines measured, an event loop's own work per wake-up
cost several times what a thread that blocks on ``recv`` and calls ``send`` costs per relayed
chunk (``benchmarks/proxy_overhead.py``). A proxy in front of an inference server has few
connections and long streams, which threads serve well. A whole answer goes back in one write
(head and body together); a streamed answer's head goes with its first chunk.

Every client is held to :class:`Limits` (head and body sizes, connections, time-outs; see
docs/proxy-limits.md): a request over one is refused with its status (400, 408, 413, 431, 503)
and counted, and its connection closed. The upstream side is :mod:`upstream`.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional
from urllib.parse import unquote

import h11

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

    h11 frames the body (its own choice of Content-Length or chunked, from the headers given)."""

    def __init__(self, connection: h11.Connection, sock: socket.socket):
        self._connection = connection
        self._socket = sock
        self._head: Optional[h11.Response] = None
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
        self._head = h11.Response(status_code=status, headers=headers)
        self.started = True

    def send(self, data: bytes) -> None:
        if data:
            self._write(self._frame(h11.Data(data=data)))

    def end(self, data: bytes = b"") -> None:
        out = self._frame(h11.Data(data=data)) if data else b""
        self._write(out + self._frame(h11.EndOfMessage()))
        self.finished = True

    def _frame(self, event) -> bytes:
        try:
            head = b""
            if self._head is not None:
                head, self._head = self._connection.send(self._head), None
            return head + self._connection.send(event)
        except h11.LocalProtocolError as exc:
            # The upstream's body does not fit the length its head declared: the client's answer
            # cannot be completed truthfully, so its connection ends here.
            raise ClientGone(f"the answer cannot be framed: {exc}") from None

    def _write(self, out: bytes) -> None:
        self.committed = True
        try:
            self._socket.sendall(out)
        except OSError as exc:  # a time-out included: a client that stopped reading
            raise ClientGone(str(exc) or type(exc).__name__) from None


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
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
    while not stopping():
        try:
            request = _read_request(connection, sock, limits)
        except _Refused as refused:
            count(refused.counter)
            _refuse(sock, refused.status, str(refused), LINGER_S)
            return
        if request is None:
            return  # the client closed the connection, or left it idle too long
        client.busy = True
        sock.settimeout(limits.idle_timeout_s)  # a client that stops reading its answer is cut off
        responder = Responder(connection, sock)
        try:
            handler(request, responder)
        finally:
            client.busy = False
        if not responder.finished or connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
            return  # the response was cut short, or one side asked to close: the connection ends here
        connection.start_next_cycle()


class _Reader:
    """h11's events of one request, read within the time-outs: a connection may idle for
    ``idle_timeout_s`` before a request's first byte, and the request must arrive within
    ``request_timeout_s`` of it."""

    def __init__(self, connection: h11.Connection, sock: socket.socket, limits: Limits):
        self._connection, self._socket, self._limits = connection, sock, limits
        self.started = bool(connection.trailing_data[0])  # a pipelined request may be there already
        self._deadline = time.monotonic() + (limits.request_timeout_s if self.started else limits.idle_timeout_s)

    def next_event(self):
        """The next event; ``None`` when the connection idled out; ``_Refused`` for a bad or late request."""
        while True:
            try:
                event = self._connection.next_event()
            except h11.RemoteProtocolError as exc:
                if exc.error_status_hint == 431:
                    raise _head_too_large(self._limits) from None
                raise _Refused(exc.error_status_hint, PROXY_BAD_REQUESTS, f"kvtrace proxy: bad request: {exc}") \
                    from None
            if event is not h11.NEED_DATA:
                return event
            try:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self._socket.settimeout(remaining)
                data = self._socket.recv(READ_SIZE)
            except TimeoutError:
                if not self.started:
                    return None  # idle: closed without a word, as a kept-alive connection may be
                raise _Refused(408, PROXY_CLIENT_TIMEOUTS, f"kvtrace proxy: the request did not arrive within "
                               f"{self._limits.request_timeout_s:g} s") from None
            if data and not self.started:
                self.started = True
                self._deadline = time.monotonic() + self._limits.request_timeout_s
            self._connection.receive_data(data)


def _read_request(connection: h11.Connection, sock: socket.socket, limits: Limits) -> Optional[Request]:
    """The next whole request, ``None`` when the client closed or idled; ``_Refused`` past a limit."""
    reader = _Reader(connection, sock, limits)
    event = reader.next_event()
    if not isinstance(event, h11.Request):
        return None  # the client closed the connection (or a time-out while idle)
    target = event.target.decode("latin-1")
    problem = target_problem(target)
    if problem:
        raise _Refused(400, PROXY_BAD_REQUESTS, f"kvtrace proxy: {problem}")
    head_bytes = len(event.method) + len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
    if head_bytes > limits.max_header_bytes:  # h11 bounds a head still arriving, not one that came whole
        raise _head_too_large(limits)
    declared = [value for name, value in event.headers if name == b"content-length"]
    if declared and int(declared[0]) > limits.max_body_bytes:
        raise _body_too_large(limits)
    if connection.they_are_waiting_for_100_continue:
        sock.settimeout(limits.request_timeout_s)
        sock.sendall(connection.send(h11.InformationalResponse(status_code=100, headers=[])))
    body = bytearray()
    while True:
        part = reader.next_event()
        if isinstance(part, h11.Data):
            body += part.data
            if len(body) > limits.max_body_bytes:  # a chunked body has no length to check first
                raise _body_too_large(limits)
        elif isinstance(part, h11.EndOfMessage):
            break
        else:
            return None  # the client closed the connection in the middle of its request
    return Request(event.method.decode("ascii"), target, target.split("?", 1)[0], list(event.headers), bytes(body))


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
    for segment in target.split("?", 1)[0].split("/"):
        if unquote(segment) in (".", ".."):
            return "the request path has a dot-segment (. or ..)"
    return None


def _refuse(sock: socket.socket, status: int, message: str, linger_s: float,
            headers: Optional[Headers] = None) -> None:
    """Answer ``status`` with a one-line body and close, after reading what the client still sends
    (for at most ``linger_s``), so that it reads the answer instead of a reset."""
    body = message.encode("utf-8")
    writer = h11.Connection(h11.SERVER)  # a state of its own: the client's may be anywhere
    out = writer.send(h11.Response(status_code=status, headers=[
        (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"), *(headers or [])]))
    out += writer.send(h11.Data(data=body)) + writer.send(h11.EndOfMessage())
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
