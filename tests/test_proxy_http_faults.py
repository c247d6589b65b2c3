"""``kvtrace proxy`` meets hostile clients and a faulty upstream, over real sockets on 127.0.0.1.

The upstream is tests/scripted_upstream.py: a small real server that drops requests after reading
them, closes kept-alive connections, and writes heads a test chose byte for byte. The real
llama-server's stories are in tests/test_proxy_llama_server.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvtrace.proxy.limits import Limits
from scripted_upstream import Answer, ScriptedUpstream, head, json_answer, openai_profile, sse_answer

pytest.importorskip("h11")  # the scripted upstream reads requests with it
pytest.importorskip("httptools")
from kvtrace.proxy.app import ProxyApp, proxy_in_thread  # noqa: E402  (needs httptools)
from kvtrace.proxy.http1 import ClientGone, Server, _Client, _serve_connection  # noqa: E402

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 2}
ANSWER = {"id": "c", "object": "text_completion", "model": "m",
          "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
          "usage": {"prompt_tokens": 4, "completion_tokens": 2}}


def exchange(port: int, raw: bytes, timeout: float = 10.0) -> bytes:
    """Write ``raw`` on a fresh connection and read until the proxy closes it (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        return read_to_end(sock)


def read_to_end(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return out
        if not data:
            return out
        out += data


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def counters(recorder) -> dict[str, int]:
    return recorder.pipeline.counters.snapshot()


def spans_after(recorder, count: int, bound_s: float = 10.0) -> int:
    """How many spans the recorder finished, once it finished at least ``count`` (or the bound passed)."""
    deadline = time.monotonic() + bound_s
    while True:
        recorder.pipeline.force_flush()
        finished = len(recorder.pipeline.exporter.get_finished_spans())
        if finished >= count or time.monotonic() > deadline:
            return finished
        time.sleep(0.02)


# --- a request reaches the upstream at most once ---------------------------------------------


def test_a_post_whose_connection_dies_after_it_was_sent_reaches_the_upstream_once(memory_recorder,
                                                                                   finished_requests):
    dropping = threading.Event()
    together = threading.Barrier(3)

    def answer(received):
        if received.target != "/v1/completions":
            return openai_profile(received)
        if dropping.is_set():
            return None  # read the request, then close without answering
        together.wait(10)  # three requests in flight at once: the proxy opens three connections
        return json_answer(ANSWER)

    with ScriptedUpstream(answer) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        warm = [threading.Thread(target=httpx.post, args=(proxy + "/v1/completions",),
                                 kwargs={"json": COMPLETION, "timeout": 30}) for _ in range(3)]
        for thread in warm:
            thread.start()
        for thread in warm:
            thread.join(30)
        assert len(upstream.requests_to("/v1/completions")) == 3  # and three kept-alive connections now
        dropping.set()
        answer = httpx.post(proxy + "/v1/completions", json=COMPLETION, timeout=30)
        assert answer.status_code == 502
        assert len(upstream.requests_to("/v1/completions")) == 4  # the dropped POST arrived once
    *_, (attributes, _, span) = finished_requests(memory_recorder)
    assert attributes["http.response.status_code"] == 502 and span.status.status_code.name == "ERROR"


def test_a_traced_request_reaches_the_upstream_as_the_client_wrote_it_with_the_added_members_in_front(
        memory_recorder):
    """Only what the proxy adds is encoded: the client's spacing, escapes and member order reach the
    upstream byte for byte (a request decoded and encoded again would lose them)."""
    written = b'  {"prompt" : "caf\\u00e9 {\\"x\\"}",\n "max_tokens":2 }'

    def answer(received):
        return openai_profile(received) or json_answer({**ANSWER, "choices": [{**ANSWER["choices"][0],
                                                                           "logprobs": None}]})

    with ScriptedUpstream(answer) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        for body in (written, b"{}"):
            sent = httpx.post(proxy + "/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=30)
            assert sent.status_code == 200
    first, empty = (received.body for received in upstream.requests_to("/v1/completions"))
    assert first == b'  {"logprobs":2,' + written[3:]
    assert json.loads(first) == {**json.loads(written), "logprobs": 2}
    assert empty == b'{"logprobs":2}'


def test_a_kept_alive_connection_the_upstream_closed_meanwhile_is_not_used(memory_recorder):
    answers: list[Answer] = []

    def answer(received):
        # Keep-alive by its head, yet the connection is closed as soon as the answer is written.
        answers.append(Answer(json_answer({"data": []}).pieces, close=True))
        return answers[-1]

    with ScriptedUpstream(answer) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        with httpx.Client(timeout=30) as client:
            assert client.get(proxy + "/v1/models").status_code == 200
            assert answers[0].closed.wait(10)
            assert client.get(proxy + "/v1/models").status_code == 200
        assert len(upstream.received) == 2


def test_an_upstream_that_closes_after_each_stream_is_not_sent_requests_into_the_close(memory_recorder):
    """llama-server closes the connection a moment after every streamed answer, its head saying
    keep-alive. Once the proxy found such a connection closed, it keeps none after a chunked answer:
    requests sent back to back, each inside the moment before the close, are all answered."""
    streams: list[Answer] = []

    def answer(received):
        if (profile := openai_profile(received)) is not None:
            return profile
        stream = sse_answer([json.dumps({**ANSWER, "object": "text_completion"}).encode(), b"[DONE]"])
        stream.close, stream.close_after_s = True, 0.5
        streams.append(stream)
        return stream

    with ScriptedUpstream(answer) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        with httpx.Client(timeout=30) as client:
            def post() -> int:
                return client.post(proxy + "/v1/completions", json={**COMPLETION, "stream": True}).status_code

            assert post() == 200
            assert streams[0].closed.wait(10)  # the next request finds that connection closed
            assert [post() for _ in range(3)] == [200] * 3
        assert len(upstream.requests_to("/v1/completions")) == 4  # each once


def test_a_connection_idle_past_the_reuse_bound_is_not_reused(memory_recorder, monkeypatch):
    """Servers close idle kept-alive connections after a few seconds; one idle that long is not risked."""
    from kvtrace.proxy import upstream as upstream_module

    monkeypatch.setattr(upstream_module, "MAX_IDLE_S", 0.3)
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder) as proxy:
        with httpx.Client(timeout=30) as client:
            for _ in range(3):  # back to back: one connection, kept alive
                assert client.get(proxy + "/v1/models").status_code == 200
            assert upstream.connections == 1
            time.sleep(0.5)
            assert client.get(proxy + "/v1/models").status_code == 200
            assert upstream.connections == 2 and len(upstream.received) == 4


# --- limits on clients ------------------------------------------------------------------------


def test_a_slow_client_is_cut_off_at_the_time_out_while_others_are_served(memory_recorder):
    limits = Limits(request_timeout_s=1.0)
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=limits) as proxy:
        slow = socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=10)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        stop = threading.Event()

        def trickle():  # one byte of a header at a time: never a whole head
            for _ in range(200):
                if stop.wait(0.1):
                    return
                try:
                    slow.sendall(b"x")
                except OSError:
                    return

        trickler = threading.Thread(target=trickle)
        trickler.start()
        try:
            with httpx.Client(timeout=30) as client:
                served = [client.get(proxy + "/v1/models").status_code for _ in range(3)]
            cut_off = read_to_end(slow)
        finally:
            stop.set()
            trickler.join(10)
            slow.close()
    assert served == [200, 200, 200]
    assert cut_off.startswith(b"HTTP/1.1 408 ")
    assert counters(memory_recorder)["proxy_client_timeouts"] == 1


def test_an_idle_connection_is_closed_after_the_idle_time_out(memory_recorder):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=Limits(idle_timeout_s=0.3)) as proxy:
        with socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=10) as idle:
            assert read_to_end(idle) == b""  # closed without a word, as a kept-alive connection may be
    assert counters(memory_recorder)["proxy_client_timeouts"] == 0


def test_a_client_that_stops_reading_its_answer_is_cut_off_at_the_idle_time_out():
    """The client's socket is blocking, bounded by the kernel's send time-out: a client that sends a
    request and never reads the answer holds its connection's thread no longer than the time-out."""
    outcome: list[str] = []
    ended = threading.Event()

    def handler(request, responder):
        responder.start(200, [(b"content-type", b"text/event-stream")])
        try:
            for _ in range(256):  # 256 MiB: far more than the sockets' buffers hold
                responder.send(b"x" * (1 << 20))
            outcome.append("written")
        except ClientGone:
            outcome.append("cut off")
        finally:
            ended.set()

    server = Server(handler, "127.0.0.1", 0, Limits(idle_timeout_s=0.5)).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            silent.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            assert ended.wait(30), "the proxy still waits on a client that does not read"
    finally:
        server.stop(grace_s=1)
    assert outcome == ["cut off"]


class CountedSocket:
    """A socket whose calls are counted by name: what a connection costs in system calls."""

    def __init__(self, sock: socket.socket):
        self._socket = sock
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attribute = getattr(self._socket, name)
        if not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attribute(*args, **kwargs)

        return counted


def test_a_kept_alive_request_costs_one_read_and_one_write_on_a_blocking_socket():
    """No time-out is set again per request (each a system call, and a Python time-out polls before
    every read and write), and an answer whose body went out ends without an empty write."""
    proxy_side, client = socket.socketpair()
    counted = CountedSocket(proxy_side)
    modes = []

    def handler(request, responder):
        modes.append(proxy_side.gettimeout())
        responder.start(200, [(b"content-length", b"2")])
        responder.send(b"ok")  # as a passed-through answer goes: its pieces, then the end
        responder.end()

    connection = _Client(counted)
    serving = threading.Thread(target=_serve_connection,
                               args=(handler, connection, Limits(), lambda name: None, lambda: False))
    serving.start()
    with client:
        client.settimeout(10)
        for _ in range(6):
            client.sendall(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                answer += client.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    serving.join(10)
    assert modes == [None] * 6  # blocking: no poll before each read and write
    # Set once for the connection: blocking, the send and the receive time-outs; then per request one
    # read and one write (+ 1 read: the one that found the close).
    assert counted.calls == {"settimeout": 1, "setsockopt": 2, "recv": 6 + 1, "send": 6}


def test_an_over_limit_body_gets_413_and_never_reaches_the_upstream(memory_recorder):
    limits = Limits(max_body_bytes=1000)
    with ScriptedUpstream(lambda received: json_answer(ANSWER)) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=limits) as proxy:
        big = json.dumps({**COMPLETION, "prompt": "x" * 5000}).encode()
        declared = httpx.post(proxy + "/v1/completions", content=big, timeout=30)
        streamed = httpx.post(proxy + "/v1/completions", content=iter([big[:600], big[600:]]), timeout=30)
        fits = httpx.post(proxy + "/v1/completions", json=COMPLETION, timeout=30)
        assert (declared.status_code, streamed.status_code, fits.status_code) == (413, 413, 200)
        assert "body is over 1000 bytes" in declared.text
        assert len(upstream.requests_to("/v1/completions")) == 1
    assert counters(memory_recorder)["proxy_refused_body"] == 2


def test_an_over_limit_head_gets_431(memory_recorder):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=Limits(max_header_bytes=4096)) as proxy:
        port = port_of(proxy)
        answers = [exchange(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * size + b"\r\n\r\n")
                   for size in (3000, 5000, 70000)]
        assert upstream.requests_to("/v1/models") and len(upstream.received) == 1
    assert answers[0].startswith(b"HTTP/1.1 200 ")
    assert all(a.startswith(b"HTTP/1.1 431 ") for a in answers[1:]), answers
    assert counters(memory_recorder)["proxy_refused_headers"] == 2


def test_a_connection_over_the_limit_gets_503_and_the_proxy_serves_again_once_one_closes(memory_recorder):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=Limits(max_connections=2)) as proxy:
        port = port_of(proxy)
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            refused = exchange(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        finally:
            for sock in held:
                sock.close()
        served = None
        for _ in range(100):  # until the proxy noticed the two closed connections
            served = exchange(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            if served.startswith(b"HTTP/1.1 200 "):
                break
            time.sleep(0.05)
    assert refused.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in refused.lower()
    assert served.startswith(b"HTTP/1.1 200 ")
    assert counters(memory_recorder)["proxy_refused_busy"] >= 1


CHILD = r'''
import json, resource, sys
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from kvtrace.config import Settings
from kvtrace.proxy.limits import Limits
from kvtrace.proxy.app import proxy_in_thread
from kvtrace.recording.recorder import Recorder

recorder = Recorder(Settings.from_env(), exporter=InMemorySpanExporter())
with proxy_in_thread(sys.argv[1], recorder, limits=Limits(idle_timeout_s=60)) as proxy:
    import os
    opened = len(os.listdir("/proc/self/fd"))
    # A few descriptors to spare: a client's socket and an upstream connection, no more.
    resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(proxy, flush=True)
    for line in sys.stdin:
        print(json.dumps(recorder.pipeline.counters.snapshot()), flush=True)
'''


def test_the_proxy_keeps_accepting_after_it_ran_out_of_descriptors(kvtrace_env):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream:
        child = subprocess.Popen([sys.executable, "-c", CHILD, upstream.url], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            proxy = child.stdout.readline().strip()
            assert proxy.startswith("http://127.0.0.1:"), proxy

            def child_counters() -> dict:
                child.stdin.write("\n")
                child.stdin.flush()
                return json.loads(child.stdout.readline())

            held = [socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=10) for _ in range(12)]
            try:
                for _ in range(200):  # until accept() failed (EMFILE) at least once
                    if child_counters()["proxy_accept_errors"]:
                        break
                    time.sleep(0.05)
                assert child_counters()["proxy_accept_errors"] >= 1
            finally:
                for sock in held:
                    sock.close()
            status = None
            for _ in range(100):  # the descriptors come back as the proxy sees those connections close
                try:
                    status = httpx.get(proxy + "/v1/models", timeout=5).status_code
                except httpx.HTTPError:
                    status = None
                if status == 200:
                    break
                time.sleep(0.1)
            assert status == 200
            assert child.poll() is None
        finally:
            child.stdin.close()
            child.wait(30)
    assert child.returncode == 0


def test_a_connection_whose_thread_cannot_start_gets_503_and_the_proxy_goes_on(memory_recorder, monkeypatch):
    import kvtrace.proxy.http1 as http1

    failures = [RuntimeError("can't start new thread")]

    class ScarceThread(threading.Thread):
        def start(self):
            if self.name == "kvtrace-proxy-connection" and failures:
                raise failures.pop()
            super().start()

    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder) as proxy:
        monkeypatch.setattr(http1.threading, "Thread", ScarceThread)
        request = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        refused, served = exchange(port_of(proxy), request), exchange(port_of(proxy), request)
    assert refused.startswith(b"HTTP/1.1 503 ") and served.startswith(b"HTTP/1.1 200 ")
    assert counters(memory_recorder)["proxy_accept_errors"] == 1


# --- framing and targets ------------------------------------------------------------------------


def test_a_framing_header_inside_another_header_does_not_change_the_answers_framing(memory_recorder,
                                                                                  finished_requests):
    body = json.dumps(ANSWER).encode()

    def answer(received):
        hostile = head(200, (("x-a", "transfer-encoding: chunked"), ("content-type", "application/json"),
                             ("content-length", str(len(body)))))
        return openai_profile(received) or Answer([hostile + body])

    with ScriptedUpstream(answer) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        with httpx.Client(timeout=30) as client:  # one connection: a framing error would spill into the next
            answers = [client.get(proxy + "/tokenize"), client.post(proxy + "/v1/completions", json=COMPLETION),
                       client.get(proxy + "/tokenize")]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all(a.content == body and a.headers["x-a"] == "transfer-encoding: chunked" for a in answers)
    assert all("transfer-encoding" not in a.headers for a in answers)
    (attributes, _, _), = finished_requests(memory_recorder)
    assert attributes["http.response.status_code"] == 200


def test_an_upstream_with_unbounded_framing_lines_is_a_502_not_a_buffer(memory_recorder):
    size_line = b"1" * 100_000  # a chunk size of 100,000 hex digits
    stream = Answer([head(200, (("transfer-encoding", "chunked"),)) + b"5\r\nhello\r\n", size_line], pause_s=0.05)
    with ScriptedUpstream(lambda received: stream) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        answer = exchange(port_of(proxy), b"GET /tokenize HTTP/1.1\r\nhost: x\r\n\r\n")
        long_head = Answer([b"HTTP/1.1 200 OK\r\nx-a: " + b"a" * 100_000 + b"\r\n\r\n"])
        upstream.answer = lambda received: long_head
        refused = exchange(port_of(proxy), b"GET /tokenize HTTP/1.1\r\nhost: x\r\n\r\n")
    # The stream had begun: the client's answer ends where the upstream's broke (no last chunk).
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"5\r\nhello\r\n")
    assert refused.startswith(b"HTTP/1.1 502 ")


@pytest.mark.parametrize("line", [
    b"GET http://127.0.0.1:1/v1/models HTTP/1.1",   # absolute form
    b"GET v1/models HTTP/1.1",                      # no leading /
    b"GET /v1/../admin HTTP/1.1",
    b"GET /v1/%2e%2E/admin HTTP/1.1",
    b"GET /a/./b HTTP/1.1",
    b"GET /.. HTTP/1.1",
    b"OPTIONS * HTTP/1.1",
    b"CONNECT 127.0.0.1:443 HTTP/1.1",
    b"GET /v1/models#fragment HTTP/1.1",
])
def test_a_target_that_is_not_a_plain_path_gets_400_and_never_reaches_the_upstream(line, memory_recorder):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder) as proxy:
        answer = exchange(port_of(proxy), line + b"\r\nhost: x\r\n\r\n")
        assert upstream.received == []
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert counters(memory_recorder)["proxy_bad_requests"] == 1


def test_dots_in_a_query_or_inside_a_segment_are_forwarded_as_they_are(memory_recorder):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url + "/base", memory_recorder) as proxy:
        for target in ("/v1/models?next=../x", "/v1/models.json", "/v1/..hidden/x"):
            assert exchange(port_of(proxy), b"GET %b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                            % target.encode()).startswith(b"HTTP/1.1 200 ")
        assert [r.target for r in upstream.received] == ["/base/v1/models?next=../x", "/base/v1/models.json",
                                                         "/base/v1/..hidden/x"]


@pytest.mark.parametrize("raw", [
    b"GET /v1/models HTTP/1.1\r\n\r\n",                                         # HTTP/1.1 without Host
    b"GET /v1/models HTTP/2.0\r\nhost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\nhost: x\n\n",                                     # bare line feeds
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
    b"0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\nabc",
])
def test_a_malformed_request_gets_400_and_never_reaches_the_upstream(raw, memory_recorder):
    with ScriptedUpstream(lambda received: json_answer({"data": []})) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder) as proxy:
        answer = exchange(port_of(proxy), raw)
        assert upstream.received == []
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert counters(memory_recorder)["proxy_bad_requests"] == 1


# --- what a client's connection carries ----------------------------------------------------------


def echo_target(received):
    return json_answer({"target": received.target})


def test_pipelined_requests_are_answered_in_order_on_one_connection(memory_recorder):
    with ScriptedUpstream(echo_target) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        answer = exchange(port_of(proxy), b"GET /v1/models?n=1 HTTP/1.1\r\nhost: x\r\n\r\n"
                                          b"GET /v1/models?n=2 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert answer.index(b"n=1") < answer.index(b"n=2")


def test_a_client_expecting_100_continue_gets_it_before_it_sends_its_body(memory_recorder):
    body = json.dumps(COMPLETION).encode()
    with ScriptedUpstream(lambda received: json_answer(ANSWER)) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder) as proxy:
        with socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"expect: 100-continue\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += sock.recv(1)
            sock.sendall(body)
            answer = read_to_end(sock)
    assert interim.startswith(b"HTTP/1.1 100 ")
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(json.dumps(ANSWER).encode())


def test_a_head_request_gets_the_head_alone_and_the_connection_goes_on(memory_recorder):
    def answer(received):
        if received.method == "HEAD":
            return Answer([head(200, (("content-type", "application/json"), ("content-length", "17")))])
        return echo_target(received)

    with ScriptedUpstream(answer) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        answer = exchange(port_of(proxy), b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
                                          b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    first, second = answer.split(b"HTTP/1.1 200 ")[1:]
    assert b"content-length: 17\r\n" in first.lower() and first.endswith(b"\r\n\r\n")
    assert second.endswith(b'{"target": "/v1/models"}')


def test_a_streamed_answer_is_chunked_to_http11_clients_and_ended_by_the_close_for_http10(memory_recorder):
    stream = sse_answer([b'{"a": 1}', b'{"a": 2}'])
    with ScriptedUpstream(lambda received: stream) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        http11 = exchange(port_of(proxy), b"GET /events HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        http10 = exchange(port_of(proxy), b"GET /events HTTP/1.0\r\n\r\n")
    events = b'data: {"a": 1}\n\ndata: {"a": 2}\n\n'
    assert b"transfer-encoding: chunked\r\n" in http11.lower() and http11.endswith(b"0\r\n\r\n")
    assert b"transfer-encoding" not in http10.lower() and b"connection: close\r\n" in http10.lower()
    assert http10.endswith(b"\r\n\r\n" + events)


def test_a_request_to_switch_protocols_is_answered_and_its_connection_ends(memory_recorder):
    with ScriptedUpstream(echo_target) as upstream, proxy_in_thread(upstream.url, memory_recorder) as proxy:
        answer = exchange(port_of(proxy), b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
                                          b"upgrade: websocket\r\n\r\nGET /v1/models?never HTTP/1.1\r\n\r\n")
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 200 ")
    assert b"connection: close\r\n" in answer.lower()
    assert [r.target for r in upstream.received] == ["/v1/models"]


# --- credentials in the upstream URL -------------------------------------------------------------


def test_credentials_in_the_upstream_url_are_refused_in_one_line_without_echoing_them(capsys):
    from kvtrace.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["proxy", "--upstream", "http://operator:hunter2@127.0.0.1:8080"])
    err = capsys.readouterr().err
    assert ended.value.code == 2
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert "hunter2" not in err and "Traceback" not in err
    from kvtrace.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        ProxyApp("http://operator:hunter2@127.0.0.1:8080")
    assert "hunter2" not in str(refused.value)


def test_the_proxy_command_takes_its_limits_and_refuses_bad_ones(capsys):
    from kvtrace.cli import main

    for flag, value in (("--max-body-bytes", "0"), ("--idle-timeout", "-1"), ("--max-connections", "many")):
        with pytest.raises(SystemExit) as ended:
            main(["proxy", "--upstream", "http://127.0.0.1:8080", flag, value])
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err


def test_the_limits_documented_are_the_defaults():
    text = (Path(__file__).resolve().parents[1] / "docs" / "proxy-limits.md").read_text()
    defaults = Limits()
    for value in (defaults.max_header_bytes, defaults.max_body_bytes, defaults.max_connections):
        assert f"{value:,}" in text or str(value) in text
    for seconds in (defaults.idle_timeout_s, defaults.request_timeout_s):
        assert f"{seconds:g} s" in text
    for name in ("proxy_bad_requests", "proxy_client_timeouts", "proxy_refused_body", "proxy_refused_headers",
                 "proxy_refused_busy", "proxy_accept_errors"):
        assert f"`{name}`" in text
