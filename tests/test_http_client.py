"""kvtrace's own HTTP calls (probe, alert delivery, the server experiment, the database's /ping) go
through one client, against real servers on 127.0.0.1: JSON in and out through kvtrace's decoder, a
redirect answered but never followed, time-outs and broken answers raised as ``OSError``.  The server
experiment tells llama-server by its ``/props`` the way the proxy does."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from receivers import Loopback

from kvtrace.http_client import HttpStatusError, get_json, post_json, request

PROPS = {"default_generation_settings": {"n_ctx": 512, "params": {"n_probs": 0}}, "total_slots": 2,
         "build_info": "b1-test", "model_ftype": "Q4_K - Medium"}


@pytest.fixture
def servers():
    started: list[Loopback] = []

    def start(answer) -> Loopback:
        started.append(Loopback(answer))
        return started[-1]

    yield start
    for server in started:
        server.close()


def test_a_post_sends_json_and_reads_json_back_as_json_loads_would(servers):
    echo = servers(lambda method, path, body: (200, {"Content-Type": "application/json"},
                                               b'{"got": ' + body + b', "big": 1e400, "nan": NaN}'))
    answer = post_json(f"{echo.url}/tokenize?x=1", {"content": "héllo", "add_special": True}, timeout_s=10,
                       headers={"baggage": "kvtrace.run_id=r"})
    assert answer["got"] == {"content": "héllo", "add_special": True}
    assert answer["big"] == float("inf") and answer["nan"] != answer["nan"]  # what msgspec refuses, json takes
    ((method, path, headers),) = echo.requests
    assert (method, path) == ("POST", "/tokenize?x=1")
    assert headers["Content-Type"] == "application/json" and headers["baggage"] == "kvtrace.run_id=r"


def test_a_redirect_is_an_answer_never_followed(servers):
    target = servers(lambda method, path, body: (200, {}, b"{}"))
    redirecting = servers(lambda method, path, body: (307, {"Location": f"{target.url}/elsewhere"}, b"moved"))
    answer = request("POST", f"{redirecting.url}/hook", {"a": 1}, {"Authorization": "Bearer t"}, timeout_s=10)
    assert (answer.status, answer.text) == (307, "moved")
    with pytest.raises(HttpStatusError) as refused:
        get_json(f"{redirecting.url}/props", timeout_s=10)
    assert (refused.value.status, refused.value.body) == (307, b"moved")
    assert target.requests == []


def test_an_answer_that_is_not_json_is_a_value_error_and_a_404_a_status_error(servers):
    server = servers(lambda method, path, body: (404 if path == "/missing" else 200, {}, b"Ok."))
    with pytest.raises(ValueError):
        get_json(f"{server.url}/ping", timeout_s=10)
    assert request("GET", f"{server.url}/ping", timeout_s=10).body == b"Ok."
    with pytest.raises(HttpStatusError) as missing:
        get_json(f"{server.url}/missing", timeout_s=10)
    assert missing.value.status == 404 and str(missing.value).startswith("HTTP 404 ")


def silent_listener(reply: bytes = b""):
    """A socket that takes connections, sends ``reply`` (if any) and then says nothing more."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            held.append(connection)
            if reply:
                connection.sendall(reply)
                connection.close()

    threading.Thread(target=accept, daemon=True).start()
    return listener, held


def test_a_server_that_takes_the_connection_and_never_answers_times_out():
    listener, held = silent_listener()
    try:
        with pytest.raises(TimeoutError):
            request("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/ping", timeout_s=0.3,
                    connect_timeout_s=5)
    finally:
        listener.close()
        for connection in held:
            connection.close()


def test_an_answer_that_is_not_http_and_a_closed_port_are_os_errors():
    listener, _ = silent_listener(b"SSH-2.0-OpenSSH_9.6\r\n")
    try:
        with pytest.raises(ConnectionError, match="no HTTP answer"):
            request("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout_s=5)
    finally:
        listener.close()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(OSError):
        request("GET", f"http://127.0.0.1:{port}/", timeout_s=5)
    with pytest.raises(ValueError):
        request("GET", "ftp://127.0.0.1/", timeout_s=5)


def test_the_experiment_tells_llama_server_by_its_props_as_the_proxy_does(servers):
    pytest.importorskip("h11")  # kvtrace.experiment.server runs the proxy
    from kvtrace.errors import EngineFailed
    from kvtrace.experiment.server import server_weight_format

    llama_server = servers(lambda method, path, body: (200, {}, json.dumps(PROPS).encode()))
    assert server_weight_format(llama_server.url) == "Q4_K_M"
    assert llama_server.requests[0][:2] == ("GET", "/props")
    for answer in ((404, {}, b'{"error": "not found"}'), (200, {}, b'{"data": []}'), (200, {}, b"[]")):
        other = servers(lambda method, path, body, answer=answer: answer)
        with pytest.raises(EngineFailed, match="is it llama-server"):
            server_weight_format(other.url)
