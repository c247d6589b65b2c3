"""The proxy's upstream reader (kvtrace/proxy/upstream.py) meets every way an HTTP/1.1 server may
frame an answer, over real sockets on 127.0.0.1: what reaches the proxy, and whether the
connection is trusted with the next request.

The upstream is tests/scripted_upstream.py, which writes each answer byte for byte.
"""

from __future__ import annotations

import socket
import threading

import pytest

from scripted_upstream import Answer, ScriptedUpstream, chunked, head

pytest.importorskip("httptools")
from kvtrace.proxy.upstream import MAX_HEAD_BYTES, Upstream, UpstreamBrokeOff, UpstreamUnreachable  # noqa: E402

BOUND_S = 10.0
"""Each socket operation's time-out: an answer the reader waits on wrongly fails the test, not hangs it."""


def fetch(upstream: Upstream, method: str = "GET", target: str = "/x"):
    answer = upstream.request(method, target, [], b"", timeout=BOUND_S)
    return answer.status, dict(answer.headers), answer.read()


def length_answer(body: bytes, *extra: tuple[str, str]) -> bytes:
    return head(200, (("content-length", str(len(body))), *extra)) + body


def test_an_answer_to_head_has_no_body_whatever_its_length_says():
    def answer(received):
        if received.method == "HEAD":
            return Answer([head(200, (("content-length", "5"),))])
        return Answer([length_answer(b"hello")])

    with ScriptedUpstream(answer) as server:
        upstream = Upstream(server.url)
        assert fetch(upstream, "HEAD") == (200, {b"content-length": b"5"}, b"")
        assert fetch(upstream, "GET") == (200, {b"content-length": b"5"}, b"hello")


def test_a_body_without_length_or_chunks_ends_with_the_connection_which_is_not_reused():
    answers = iter([Answer([head(200, (("content-type", "text/plain"),)) + b"first ", b"and last"],
                           close=True, pause_s=0.05),
                    Answer([length_answer(b"next")])])
    with ScriptedUpstream(lambda received: next(answers)) as server:
        upstream = Upstream(server.url)
        assert fetch(upstream)[2] == b"first and last"
        assert fetch(upstream)[2] == b"next"
        assert server.connections == 2


def test_interim_answers_are_skipped_and_the_real_one_is_relayed():
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n"
    answers = iter([Answer([interim, length_answer(b"hello", ("x-a", " padded "))], pause_s=0.02),
                    Answer([length_answer(b"again")])])
    with ScriptedUpstream(lambda received: next(answers)) as server:
        upstream = Upstream(server.url)
        assert fetch(upstream) == (200, {b"content-length": b"5", b"x-a": b"padded"}, b"hello")
        assert fetch(upstream)[2] == b"again"
        assert server.connections == 1  # a well-framed answer leaves its connection reusable


def test_bytes_after_an_answer_are_never_relayed_and_its_connection_is_not_reused():
    answers = iter([Answer([length_answer(b"hello") + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nforged"]),
                    Answer([length_answer(b"the answer") + b"garbage"]),
                    Answer([length_answer(b"fresh")])])
    with ScriptedUpstream(lambda received: next(answers)) as server:
        upstream = Upstream(server.url)
        assert fetch(upstream)[2] == b"hello"
        assert fetch(upstream)[2] == b"the answer"
        assert fetch(upstream)[2] == b"fresh"
        assert server.connections == 3


def test_trailers_are_read_past_and_not_relayed():
    body = b"5\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n"
    answers = iter([Answer([head(200, (("transfer-encoding", "chunked"),)) + body]), Answer([length_answer(b"ok")])])
    with ScriptedUpstream(lambda received: next(answers)) as server:
        upstream = Upstream(server.url)
        assert fetch(upstream) == (200, {b"transfer-encoding": b"chunked"}, b"hello")
        assert fetch(upstream)[2] == b"ok"
        assert server.connections == 1


def test_a_head_over_the_bound_is_refused_whether_it_comes_whole_or_in_pieces():
    line = b"x-a: " + b"a" * (MAX_HEAD_BYTES // 2) + b"\r\n"
    over = b"HTTP/1.1 200 OK\r\n" + line + line + b"content-length: 0\r\n\r\n"
    for pieces in ([over], [over[:1000], over[1000:]]):
        with ScriptedUpstream(lambda received: Answer(pieces, pause_s=0.01)) as server:
            with pytest.raises(UpstreamUnreachable, match=f"over {MAX_HEAD_BYTES} bytes"):
                fetch(Upstream(server.url))
    within = b"HTTP/1.1 200 OK\r\n" + line + b"content-length: 2\r\n\r\nok"
    with ScriptedUpstream(lambda received: Answer([within])) as server:
        assert fetch(Upstream(server.url))[2] == b"ok"


def test_trailers_over_the_bound_break_the_answer_off_after_its_body():
    trailer = b"x-t: " + b"t" * MAX_HEAD_BYTES
    stream = Answer([head(200, (("transfer-encoding", "chunked"),)) + b"5\r\nhello\r\n0\r\n", trailer], pause_s=0.02)
    with ScriptedUpstream(lambda received: stream) as server:
        answer = Upstream(server.url).request("GET", "/x", [], b"", timeout=BOUND_S)
        pieces = answer.chunks()
        assert next(pieces) == b"hello"
        with pytest.raises(UpstreamBrokeOff, match=f"over {MAX_HEAD_BYTES} bytes"):
            next(pieces)


@pytest.mark.parametrize("raw", [
    b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    b"HTTP/1.1 200 OK\ncontent-length: 0\n\n",                                      # no CR
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nabc",                         # not chunked
    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
])
def test_a_head_that_is_not_a_relayable_answer_is_unreachable(raw):
    with ScriptedUpstream(lambda received: Answer([raw], close=True)) as server:
        with pytest.raises(UpstreamUnreachable):
            fetch(Upstream(server.url))


@pytest.mark.parametrize("rest", [
    b"zz\r\nbad\r\n",                                   # a chunk size that is not hex
    b"fffffffffffffffffffff\r\n",                      # one that overflows
    b"5\r\nhello" + b"x" * 10,                          # a chunk longer than its size
])
def test_broken_framing_after_the_first_chunk_breaks_the_answer_off_after_what_came(rest):
    stream = Answer([head(200, (("transfer-encoding", "chunked"),)) + b"5\r\nhello\r\n", rest], pause_s=0.02,
                    close=True)
    with ScriptedUpstream(lambda received: stream) as server:
        answer = Upstream(server.url).request("GET", "/x", [], b"", timeout=BOUND_S)
        pieces = answer.chunks()
        assert next(pieces) == b"hello"
        with pytest.raises(UpstreamBrokeOff):
            list(pieces)


def test_a_close_before_the_declared_length_breaks_the_answer_off():
    short = Answer([head(200, (("content-length", "50"),)) + b'{"choi'], close=True)
    with ScriptedUpstream(lambda received: short) as server:
        with pytest.raises(UpstreamBrokeOff, match="before the answer's end"):
            fetch(Upstream(server.url))


def test_a_close_without_a_byte_of_answer_is_unreachable():
    with ScriptedUpstream(lambda received: None) as server:
        with pytest.raises(UpstreamUnreachable, match="without answering"):
            fetch(Upstream(server.url))


def test_a_header_that_http_cannot_carry_is_refused_before_a_byte_leaves():
    with ScriptedUpstream(lambda received: Answer([length_answer(b"ok")])) as server:
        upstream = Upstream(server.url)
        for headers in ([(b"x-a", b"1\r\nx-injected: 2")], [(b"x-a", b"1\nx-injected: 2")], [(b"x-a", b"1\r")],
                        [(b"x-a", b"1\x00")], [(b"x a", b"1")], [(b"", b"1")]):
            with pytest.raises(UpstreamUnreachable, match="cannot be written"):
                upstream.request("GET", "/x", headers, b"")
        assert server.received == []


def test_a_chunk_goes_on_in_the_pieces_each_read_brings_never_held_back_whole():
    """A chunk's first bytes reach the reader before the server has written the rest of it."""
    listener = socket.create_server(("127.0.0.1", 0))
    rest_may_go = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(head(200, (("transfer-encoding", "chunked"),)) + b"a\r\nhello")
            rest_may_go.wait(BOUND_S)
            conn.sendall(b"world\r\n" + chunked([b"!"]))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    with listener:
        answer = Upstream(f"http://127.0.0.1:{listener.getsockname()[1]}").request("GET", "/x", [], b"",
                                                                                timeout=BOUND_S)
        pieces = answer.chunks()
        first = next(pieces)
        rest_may_go.set()
        assert first == b"hello"
        assert b"".join(pieces) == b"world!"
    server.join(BOUND_S)


def test_a_kept_alive_connection_is_reused_after_one_look_with_its_time_out_left_as_it_is(monkeypatch):
    """Reusing a connection costs one look at its socket (a poll registered once, not built anew) and
    no time-out set again: a request on it is one write and the reads of its answer."""
    import select

    with ScriptedUpstream(lambda received: Answer([length_answer(b"hello")])) as server:
        upstream = Upstream(server.url)
        assert fetch(upstream)[2] == b"hello"
        connection = upstream._idle[BOUND_S][0]
        calls: list[str] = []
        real_socket, real_poll = connection.socket, select.poll

        class Watched:
            def __getattr__(self, name):
                calls.append(name)
                return getattr(real_socket, name)

        monkeypatch.setattr(select, "poll", lambda: calls.append("poll()") or real_poll())
        connection.socket = Watched()
        for _ in range(3):
            assert fetch(upstream)[2] == b"hello"
        assert server.connections == 1
        assert [name for name in calls if name not in ("gettimeout", "fileno")] == ["send", "recv"] * 3


class _WatchedSocket:
    """A connection's socket whose calls are listed by name."""

    def __init__(self, real: socket.socket, calls: list[str]):
        self._real, self._calls = real, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._real, name)


def test_a_json_call_is_one_write_and_one_read_of_the_request_request_would_write():
    """The integrity check's calls: the same request as `request` sends (its head built once per target),
    one write and one read on a kept connection, and the whole answer back."""
    with ScriptedUpstream(lambda received: Answer([length_answer(b'{"tokens": [1, 2]}')])) as server:
        upstream = Upstream(server.url + "/base")
        assert upstream.post_json("/tokenize", b'{"content": "hi"}', timeout=BOUND_S) == (200, b'{"tokens": [1, 2]}')
        connection = upstream._idle[BOUND_S][0]
        calls: list[str] = []
        connection.socket = _WatchedSocket(connection.socket, calls)
        for body in (b'{"content": "a"}', b'{"content": "hello there"}'):
            assert upstream.post_json("/tokenize", body, timeout=BOUND_S)[0] == 200
        assert [name for name in calls if name != "fileno"] == ["send", "recv"] * 2
        assert server.connections == 1
        for received, body in zip(server.received, (b'{"content": "hi"}', b'{"content": "a"}',
                                                    b'{"content": "hello there"}')):
            assert (received.method, received.target, received.body) == ("POST", "/base/tokenize", body)
            assert received.headers["content-type"] == "application/json"
            assert received.headers["content-length"] == str(len(body))
            assert received.headers["host"] == server.url.removeprefix("http://")


def test_requests_with_and_without_a_time_out_each_reuse_a_connection_set_for_theirs():
    """The relay's requests (no time-out) and the integrity calls' (30 s) alternate: each reuses an idle
    connection whose kernel time-out is already its own, on a blocking socket (no poll before each read
    and write, no time-out set again)."""
    with ScriptedUpstream(lambda received: Answer([length_answer(b"ok")])) as server:
        upstream = Upstream(server.url)
        assert upstream.request("GET", "/x", [], b"").read() == b"ok"
        assert upstream.post_json("/y", b"{}", timeout=BOUND_S) == (200, b"ok")
        calls: list[str] = []
        for connection in (upstream._idle[None][0], upstream._idle[BOUND_S][0]):
            assert connection.socket.gettimeout() is None  # blocking: the time-out is the kernel's
            connection.socket = _WatchedSocket(connection.socket, calls)
        for _ in range(3):
            assert upstream.request("GET", "/x", [], b"").read() == b"ok"
            assert upstream.post_json("/y", b"{}", timeout=BOUND_S) == (200, b"ok")
        assert server.connections == 2
        assert "setsockopt" not in calls and "settimeout" not in calls
        bounded = upstream._idle[BOUND_S][0].socket
        assert bounded.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == \
            bounded.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16) != bytes(16)


def test_an_upstream_that_stops_sending_fails_the_request_at_its_time_out():
    """The kernel's time-out bounds each read: an answer that stops midway, or never begins, ends the
    request instead of holding its thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def serve():
        held = []
        for first in (b"", head(200, (("content-length", "10"),)) + b"{}"):
            conn, _ = listener.accept()
            held.append(conn)
            conn.recv(65536)
            if first:
                conn.sendall(first)
        release.wait(BOUND_S)
        for conn in held:
            conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        upstream = Upstream(f"http://127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(UpstreamUnreachable):
            upstream.request("GET", "/x", [], b"", timeout=0.2)
        with pytest.raises(UpstreamBrokeOff):
            upstream.post_json("/x", b"{}", timeout=0.2)
    finally:
        release.set()
        server.join(BOUND_S)
        listener.close()


def test_past_the_idle_bound_the_connection_idle_longest_is_closed_whatever_its_time_out(monkeypatch):
    import kvtrace.proxy.upstream as upstream_module

    monkeypatch.setattr(upstream_module, "MAX_IDLE_CONNECTIONS", 1)
    with ScriptedUpstream(lambda received: Answer([length_answer(b"ok")])) as server:
        upstream = Upstream(server.url)
        assert upstream.request("GET", "/x", [], b"").read() == b"ok"  # idle first: closed for the next one
        assert upstream.post_json("/y", b"{}", timeout=BOUND_S) == (200, b"ok")
        assert upstream.post_json("/y", b"{}", timeout=BOUND_S) == (200, b"ok")
        assert server.connections == 2  # the second call reused the connection of the first
        assert upstream.request("GET", "/x", [], b"").read() == b"ok"
        assert server.connections == 3
