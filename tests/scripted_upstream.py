"""A tiny real HTTP/1.1 upstream on 127.0.0.1 whose answers the test writes byte for byte: the fault
injector for the proxy's tests (a request dropped after it was read, hostile heads, broken framing).

It reads each request with h11 and records it, then calls ``answer(request)``: ``None`` closes the
connection without a byte of answer; an :class:`Answer` is written as it is, piece by piece.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import h11


@dataclass
class Received:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Answer:
    pieces: list[bytes]
    """Written one after another (each its own write)."""
    close: bool = False
    """Close the connection once it is written (whatever the head said)."""
    close_after_s: float = 0.0
    """With ``close``: wait this long first (a request sent meanwhile is never read)."""
    pause_s: float = 0.0
    """Between pieces."""
    closed: threading.Event = field(default_factory=threading.Event)
    """Set once the connection was closed after this answer."""


def head(status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} Scripted"] + [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def json_answer(document, status: int = 200, extra: tuple[tuple[str, str], ...] = ()) -> Answer:
    body = json.dumps(document).encode()
    return Answer([head(status, (("content-type", "application/json"), ("content-length", str(len(body))),
                                 *extra)) + body])


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"


def sse_answer(events: list[bytes]) -> Answer:
    """A streamed answer, one chunk per event (``events`` are the ``data:`` payloads)."""
    return Answer([head(200, (("content-type", "text/event-stream"), ("transfer-encoding", "chunked"))) +
                   chunked([b"data: " + e + b"\n\n" for e in events])])


OPENAI_MODELS = json.dumps({"object": "list", "data": [{"id": "m", "owned_by": "scripted"}]}).encode()


def openai_profile(received: Received) -> Optional[Answer]:
    """What an OpenAI-compatible server (not llama-server) says to the proxy's profile questions; else None."""
    if received.target == "/props":
        return json_answer({"error": "not found"}, status=404)
    if received.target == "/v1/models":
        return Answer([head(200, (("content-type", "application/json"),
                                  ("content-length", str(len(OPENAI_MODELS))))) + OPENAI_MODELS])
    return None


class ScriptedUpstream:
    def __init__(self, answer: Callable[[Received], Optional[Answer]]):
        self.answer = answer
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> "ScriptedUpstream":
        self._accepting.start()
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(5)

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        with self._lock:
            return len(self._sockets)

    def requests_to(self, target: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.target == target]

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            with self._lock:
                self._sockets.append(sock)
                self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        leftover = b""
        with sock:
            sock.settimeout(30)
            while True:
                reader = h11.Connection(h11.SERVER)
                if leftover:  # (b"" would say the connection ended)
                    reader.receive_data(leftover)
                received = self._read(reader, sock)
                if received is None:
                    return
                leftover = reader.trailing_data[0]
                with self._lock:
                    self.received.append(received)
                answer = self.answer(received)
                if answer is None:
                    return  # dropped: read, and never answered
                try:
                    for i, piece in enumerate(answer.pieces):
                        if i and answer.pause_s:
                            time.sleep(answer.pause_s)
                        sock.sendall(piece)
                except OSError:
                    return
                if answer.close:
                    time.sleep(answer.close_after_s)
                    sock.close()
                    answer.closed.set()
                    return

    @staticmethod
    def _read(reader: h11.Connection, sock: socket.socket) -> Optional[Received]:
        request, body = None, b""
        while True:
            try:
                event = reader.next_event()
            except h11.RemoteProtocolError:
                return None
            if event is h11.NEED_DATA:
                try:
                    reader.receive_data(sock.recv(65536))
                except OSError:
                    return None
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage) and request is not None:
                return Received(request.method.decode(), request.target.decode("latin-1"),
                                {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}, body)
            else:
                return None
