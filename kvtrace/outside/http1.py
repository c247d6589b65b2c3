"""The proxy's HTTP/1.1, both sides, on asyncio streams and h11 (the protocol state machine httpx
and uvicorn use themselves).

Why not an ASGI server and an HTTP client library: on the machines measured, each extra write to a
socket and each layer of the general-purpose stacks cost more than everything kvtrace does with a
request (``benchmarks/proxy_overhead.py``). Here a request goes upstream in one write, a whole
answer goes back in one write (head and body together), a streamed answer's head goes with its
first chunk, and upstream connections are kept alive and reused.

* :func:`start_server` serves ``handler(request, responder)`` on a host and port.
* :class:`Upstream` sends requests to one base URL over kept-alive connections.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional
from urllib.parse import urlsplit

import h11

READ_SIZE = 65536
CONNECT_TIMEOUT_S = 30.0
Headers = list[tuple[bytes, bytes]]


class UpstreamUnreachable(Exception):
    """No connection to the upstream, or it closed before answering."""


class UpstreamBrokeOff(Exception):
    """The upstream's answer stopped before its end."""


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

    def __init__(self, connection: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._connection = connection
        self._reader = reader
        self._writer = writer
        self._head: Optional[bytes] = None
        self.started = False
        self.finished = False

    @property
    def client_gone(self) -> bool:
        return self._writer.transport.is_closing() or self._reader.at_eof()

    def start(self, status: int, headers: Headers) -> None:
        self._head = self._connection.send(h11.Response(status_code=status, headers=headers))
        self.started = True

    async def send(self, data: bytes) -> None:
        if data:
            await self._write(self._connection.send(h11.Data(data=data)))

    async def end(self, data: bytes = b"") -> None:
        out = self._connection.send(h11.Data(data=data)) if data else b""
        self.finished = True
        await self._write(out + self._connection.send(h11.EndOfMessage()))

    async def _write(self, out: bytes) -> None:
        if self._head is not None:
            out, self._head = self._head + out, None
        self._writer.write(out)
        await self._writer.drain()


Handler = Callable[[Request, Responder], Awaitable[None]]


async def start_server(handler: Handler, host: str, port: int) -> asyncio.AbstractServer:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _serve_connection(handler, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(connection, host, port, limit=READ_SIZE)


async def _serve_connection(handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    connection = h11.Connection(h11.SERVER)
    while True:
        try:
            event = await _next_event(connection, reader)
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                return
            if connection.they_are_waiting_for_100_continue:
                writer.write(connection.send(h11.InformationalResponse(status_code=100, headers=[])))
            body = bytearray()
            while True:
                part = await _next_event(connection, reader)
                if isinstance(part, h11.Data):
                    body += part.data
                elif isinstance(part, h11.EndOfMessage):
                    break
                else:
                    return
        except h11.RemoteProtocolError as exc:
            if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                message = f"bad request: {exc}".encode()
                writer.write(connection.send(h11.Response(status_code=exc.error_status_hint, headers=[
                    (b"content-type", b"text/plain"), (b"content-length", str(len(message)).encode()),
                    (b"connection", b"close")])) + connection.send(h11.Data(data=message))
                    + connection.send(h11.EndOfMessage()))
                await writer.drain()
            return
        target = event.target.decode("latin-1")
        request = Request(event.method.decode("ascii"), target, target.split("?", 1)[0], list(event.headers),
                          bytes(body))
        responder = Responder(connection, reader, writer)
        await handler(request, responder)
        if not responder.finished or connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
            return  # the response was cut short, or one side asked to close: the connection ends here
        connection.start_next_cycle()


async def _next_event(connection: h11.Connection, reader: asyncio.StreamReader):
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(await reader.read(READ_SIZE))


# --- the upstream side --------------------------------------------------------------------------


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """An answer whose body is read as it arrives; its connection goes back to the pool at the end."""

    def __init__(self, upstream: "Upstream", connection: _Connection, response: h11.Response):
        self._upstream = upstream
        self._connection = connection
        self.status = response.status_code
        self.headers: Headers = list(response.headers)
        self._done = False

    def header(self, name: bytes) -> str:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return ""

    async def chunks(self) -> AsyncIterator[bytes]:
        connection = self._connection
        try:
            while True:
                event = connection.h11.next_event()
                if event is h11.NEED_DATA:
                    data = await connection.reader.read(READ_SIZE)
                    connection.h11.receive_data(data)
                    continue
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self._done = True
                    self._upstream._release(connection)
                    return
                else:
                    raise UpstreamBrokeOff(f"unexpected {type(event).__name__} in the answer")
        except (OSError, h11.RemoteProtocolError) as exc:
            raise UpstreamBrokeOff(str(exc) or type(exc).__name__) from None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        """Give up on the rest of the answer (its connection cannot be reused)."""
        if not self._done:
            self._done = True
            self._connection.close()


class Upstream:
    """Requests to one server (``http(s)://host:port``), over connections kept alive between requests."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default_port = self.port == (443 if self.tls else 80)
        self.host_header = (self.host if default_port else f"{self.host}:{self.port}").encode("idna")
        self._idle: list[_Connection] = []

    async def request(self, method: str, target: str, headers: Headers, body: bytes) -> UpstreamResponse:
        """Send a request; returns once the answer's head arrived (``UpstreamUnreachable`` if it does not)."""
        framing = [(b"host", self.host_header), (b"content-length", str(len(body)).encode())]
        event = h11.Request(method=method, target=(self.prefix + target).encode("latin-1"),
                            headers=framing + headers)
        while True:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._connect()
            try:
                connection.writer.write(connection.h11.send(event) + connection.h11.send(h11.Data(data=body))
                                        + connection.h11.send(h11.EndOfMessage()))
                while True:
                    answer = connection.h11.next_event()
                    if answer is h11.NEED_DATA:
                        connection.h11.receive_data(await connection.reader.read(READ_SIZE))
                    elif isinstance(answer, h11.InformationalResponse):
                        continue
                    elif isinstance(answer, h11.Response):
                        return UpstreamResponse(self, connection, answer)
                    else:
                        raise UpstreamUnreachable("the upstream closed the connection without answering")
            except (OSError, h11.RemoteProtocolError, UpstreamUnreachable) as exc:
                connection.close()
                if reused:
                    continue  # a kept-alive connection the upstream had closed meanwhile: once more, fresh
                raise UpstreamUnreachable(str(exc) or type(exc).__name__) from None

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=ssl.create_default_context() if self.tls else None,
                                        limit=READ_SIZE),
                CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamUnreachable(f"cannot connect to {self.host}:{self.port} ({exc or 'time-out'})") from None
        return _Connection(reader, writer)

    def _release(self, connection: _Connection) -> None:
        if connection.h11.our_state is h11.DONE and connection.h11.their_state is h11.DONE:
            connection.h11.start_next_cycle()
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
