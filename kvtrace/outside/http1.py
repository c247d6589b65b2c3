"""The proxy's HTTP/1.1, both sides: blocking sockets, one thread per client connection, and h11
(the protocol state machine httpx and uvicorn use themselves).

Why not an ASGI server and an HTTP client library, or asyncio at all: on the machines measured, the
event loop's own work per wake-up (about 100 µs of CPU per relayed chunk on a 2-core VM, against
about 20 µs for a thread that blocks on ``recv`` and calls ``send``) and every extra socket write
cost more than everything kvtrace does with a request (``benchmarks/proxy_overhead.py``). A proxy
in front of an inference server has few connections and long streams, which threads serve well.
So: a request goes upstream in one write, a whole answer goes back in one (head and body
together), a streamed answer's head goes with its first chunk, and upstream connections are kept
alive and reused.

* :class:`Server` serves ``handler(request, responder)`` on a host and port.
* :class:`Upstream` sends requests to one base URL over kept-alive connections (a small client of
  its own; see the note above it).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional
from urllib.parse import urlsplit

import h11

log = logging.getLogger("kvtrace.proxy")

READ_SIZE = 65536
CONNECT_TIMEOUT_S = 30.0
Headers = list[tuple[bytes, bytes]]


class UpstreamUnreachable(Exception):
    """No connection to the upstream, or it closed before answering."""


class UpstreamBrokeOff(Exception):
    """The upstream's answer stopped before its end."""


class ClientGone(Exception):
    """The client closed its connection while its answer was being written."""


# --- the server side ---------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    target: str
    """Path and query, as the client sent them."""
    path: str
    headers: Headers
    body: bytes


class Responder:
    """Writes one response; the head waits for the first body bytes so both leave in one write."""

    def __init__(self, connection: h11.Connection, sock: socket.socket):
        self._connection = connection
        self._socket = sock
        self._head: Optional[bytes] = None
        self._chunked = False
        self.started = False
        self.finished = False

    @property
    def client_gone(self) -> bool:
        """Whether the client closed its end (a look at the socket, nothing read)."""
        try:
            return self._socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def start(self, status: int, headers: Headers) -> None:
        self._head = self._connection.send(h11.Response(status_code=status, headers=headers))
        self.started = True
        # Without a length, h11 frames the body in chunks for an HTTP/1.1 client; then the proxy writes
        # each chunk's framing itself (what h11 would write; its state does not depend on it), a
        # fraction of h11's cost per streamed chunk.
        self._chunked = b"transfer-encoding: chunked" in self._head.lower()

    def send(self, data: bytes) -> None:
        if data:
            if self._chunked:
                self._write(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                self._write(self._connection.send(h11.Data(data=data)))

    def end(self, data: bytes = b"") -> None:
        out = self._connection.send(h11.Data(data=data)) if data else b""
        self.finished = True
        self._write(out + self._connection.send(h11.EndOfMessage()))

    def _write(self, out: bytes) -> None:
        if self._head is not None:
            out, self._head = self._head + out, None
        try:
            self._socket.sendall(out)
        except OSError as exc:
            raise ClientGone(str(exc)) from None


Handler = Callable[[Request, Responder], None]


class _Client:
    """One client connection and whether a request of it is being answered."""

    def __init__(self, sock: socket.socket):
        self.socket = sock
        self.busy = False
        self.thread: Optional[threading.Thread] = None


class Server:
    """A listening socket and a thread per client connection.

    :meth:`stop` stops accepting, lets the requests being answered finish (their records with
    them) for up to ``grace_s`` seconds, and closes the connections that wait for a next request.
    """

    def __init__(self, handler: Handler, host: str, port: int):
        self._handler = handler
        self._listener = socket.create_server((host, port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="kvtrace-proxy-accept", daemon=True)
        self._clients: set[_Client] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> "Server":
        self._thread.start()
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        self._stopping = True
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
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # stopped
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = _Client(sock)
            client.thread = threading.Thread(target=self._serve, args=(client,), name="kvtrace-proxy-connection",
                                             daemon=True)
            with self._lock:
                self._clients.add(client)
            client.thread.start()

    def _serve(self, client: _Client) -> None:
        try:
            _serve_connection(self._handler, client, lambda: self._stopping)
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


def _serve_connection(handler: Handler, client: _Client, stopping: Callable[[], bool]) -> None:
    sock = client.socket
    connection = h11.Connection(h11.SERVER)
    while not stopping():
        try:
            event = _next_event(connection, sock)
            if not isinstance(event, h11.Request):
                return  # the client closed the connection
            client.busy = True
            if connection.they_are_waiting_for_100_continue:
                sock.sendall(connection.send(h11.InformationalResponse(status_code=100, headers=[])))
            body = bytearray()
            while True:
                part = _next_event(connection, sock)
                if isinstance(part, h11.Data):
                    body += part.data
                elif isinstance(part, h11.EndOfMessage):
                    break
                else:
                    return
        except h11.RemoteProtocolError as exc:
            if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                message = f"bad request: {exc}".encode()
                sock.sendall(connection.send(h11.Response(status_code=exc.error_status_hint, headers=[
                    (b"content-type", b"text/plain"), (b"content-length", str(len(message)).encode()),
                    (b"connection", b"close")])) + connection.send(h11.Data(data=message))
                    + connection.send(h11.EndOfMessage()))
            return
        target = event.target.decode("latin-1")
        request = Request(event.method.decode("ascii"), target, target.split("?", 1)[0], list(event.headers),
                          bytes(body))
        responder = Responder(connection, sock)
        try:
            handler(request, responder)
        finally:
            client.busy = False
        if not responder.finished or connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
            return  # the response was cut short, or one side asked to close: the connection ends here
        connection.start_next_cycle()


def _next_event(connection: h11.Connection, sock: socket.socket):
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(sock.recv(READ_SIZE))


# --- the upstream side --------------------------------------------------------------------------
# A small HTTP/1.1 client of its own: the upstream is one server the proxy talks to with requests it
# frames itself, and reading its answers with h11 cost several times a plain relay per streamed
# chunk. Heads are parsed once; bodies are framed by Content-Length, chunked transfer coding, or the
# connection's end.


class _Connection:
    def __init__(self, sock: socket.socket):
        self.socket = sock
        self.buffer = bytearray()

    def fill(self) -> bool:
        """Read what has arrived into the buffer; False at the connection's end."""
        data = self.socket.recv(READ_SIZE)
        self.buffer += data
        return bool(data)

    def close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass


class UpstreamResponse:
    """An answer whose body is read as it arrives; its connection goes back to the pool at the end."""

    def __init__(self, upstream: "Upstream", connection: _Connection, status: int, headers: Headers,
                 bodyless: bool):
        self._upstream = upstream
        self._connection = connection
        self.status = status
        self.headers = headers
        self._done = False
        self._bodyless = bodyless
        self._reusable = self.header(b"connection").lower() != "close"

    def header(self, name: bytes) -> str:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return ""

    def chunks(self) -> Iterator[bytes]:
        try:
            if self._bodyless:
                pieces: Iterator[bytes] = iter(())
            elif "chunked" in self.header(b"transfer-encoding").lower():
                pieces = self._chunked()
            elif self.header(b"content-length"):
                pieces = self._sized(int(self.header(b"content-length")))
            else:
                self._reusable = False
                pieces = self._until_closed()
            yield from pieces
        except (OSError, ValueError) as exc:
            raise UpstreamBrokeOff(str(exc) or type(exc).__name__) from None
        self._done = True
        if self._reusable:
            self._upstream._release(self._connection)
        else:
            self._connection.close()

    def _chunked(self) -> Iterator[bytes]:
        connection = self._connection
        buffer = connection.buffer
        while True:
            line_end = buffer.find(b"\r\n")
            while line_end == -1:
                if not connection.fill():
                    raise UpstreamBrokeOff("the connection ended inside a chunk's size line")
                line_end = buffer.find(b"\r\n")
            size = int(bytes(buffer[:line_end]).split(b";", 1)[0].strip(), 16)
            if size == 0:
                del buffer[:line_end + 2]
                self._skip_trailers()
                return
            end = line_end + 2 + size
            while len(buffer) < end + 2:
                if not connection.fill():
                    raise UpstreamBrokeOff("the connection ended inside a chunk")
            data = bytes(buffer[line_end + 2:end])
            del buffer[:end + 2]
            yield data

    def _skip_trailers(self) -> None:
        connection = self._connection
        while True:
            line_end = connection.buffer.find(b"\r\n")
            while line_end == -1:
                if not connection.fill():
                    raise UpstreamBrokeOff("the connection ended inside the trailers")
                line_end = connection.buffer.find(b"\r\n")
            del connection.buffer[:line_end + 2]
            if line_end == 0:
                return

    def _sized(self, remaining: int) -> Iterator[bytes]:
        connection = self._connection
        while remaining > 0:
            if not connection.buffer and not connection.fill():
                raise UpstreamBrokeOff(f"the connection ended {remaining} bytes before the answer's end")
            data = bytes(connection.buffer[:remaining])
            del connection.buffer[:len(data)]
            remaining -= len(data)
            yield data

    def _until_closed(self) -> Iterator[bytes]:
        connection = self._connection
        while True:
            if connection.buffer:
                data = bytes(connection.buffer)
                connection.buffer.clear()
                yield data
            if not connection.fill():
                return

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
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default_port = self.port == (443 if self.tls else 80)
        self.host_header = (self.host if default_port else f"{self.host}:{self.port}").encode("idna")
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def request(self, method: str, target: str, headers: Headers, body: bytes,
                timeout: Optional[float] = None) -> UpstreamResponse:
        """Send a request; returns once the answer's head arrived (``UpstreamUnreachable`` if it does not).

        ``timeout`` bounds each socket operation of this request (``None``: a generation takes as
        long as it takes, as it would without the proxy).
        """
        head = [f"{method} {self.prefix}{target} HTTP/1.1\r\n".encode("latin-1"),
                b"host: " + self.host_header + b"\r\n", b"content-length: %d\r\n" % len(body)]
        head += [name + b": " + value + b"\r\n" for name, value in headers]
        message = b"".join(head) + b"\r\n" + body
        while True:
            connection = self._take()
            reused = connection is not None
            if connection is None:
                connection = self._connect()
            connection.socket.settimeout(timeout)
            try:
                connection.socket.sendall(message)
                while True:
                    status, response_headers = self._read_head(connection)
                    if status >= 200:
                        break  # 1xx answers are interim: the real one follows
                bodyless = method == "HEAD" or status in (204, 304)
                return UpstreamResponse(self, connection, status, response_headers, bodyless)
            except (OSError, ValueError, UpstreamUnreachable) as exc:
                connection.close()
                if reused:
                    continue  # a kept-alive connection the upstream had closed meanwhile: once more, fresh
                raise UpstreamUnreachable(str(exc) or type(exc).__name__) from None

    @staticmethod
    def _read_head(connection: _Connection) -> tuple[int, Headers]:
        buffer = connection.buffer
        end = buffer.find(b"\r\n\r\n")
        while end == -1:
            if len(buffer) > 1 << 20:
                raise UpstreamUnreachable("the answer's head is over 1 MiB")
            if not connection.fill():
                raise UpstreamUnreachable("the upstream closed the connection without answering")
            end = buffer.find(b"\r\n\r\n")
        lines = bytes(buffer[:end]).split(b"\r\n")
        del buffer[:end + 4]
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise UpstreamUnreachable(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
        status = int(rest[:3])
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        return status, headers

    def _take(self) -> Optional[_Connection]:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to {self.host}:{self.port} ({exc})") from None
        return _Connection(sock)

    def _release(self, connection: _Connection) -> None:
        if connection.buffer:
            connection.close()  # bytes after the answer's end: not a connection to trust again
            return
        with self._lock:
            self._idle.append(connection)

    def close(self) -> None:
        with self._lock:
            while self._idle:
                self._idle.pop().close()
