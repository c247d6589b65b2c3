"""benchmarks/proxy_throughput.py's fake llama-server and client, through the proxy in this process: the
benchmark measures what it says only while its streams are whole, their logprobs cut, and each marked
request's task is in its log for the proxy to find."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from kvtrace import semconv as sc
from kvtrace.proxy.app import proxy_in_thread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import proxy_throughput as benchmark  # noqa: E402

TOKENS = 16


def test_the_fake_server_s_streams_and_answers_reach_the_client_whole_and_the_log_ties_each_to_its_task(
        tmp_path, memory_recorder, finished_requests):
    logs = [tmp_path / "server-a.log", tmp_path / "server-b.log"]
    fake = benchmark.FakeLlamaServer(TOKENS, 0, logs)
    fake.serve()
    ports = [listener.getsockname()[1] for listener in fake.listeners]
    requests = []
    for port, log in zip(ports, logs):
        with proxy_in_thread(f"http://127.0.0.1:{port}", memory_recorder, llama_server_log=log) as proxy:
            streams = benchmark._drive(proxy, True, TOKENS, 0.2, 2, False)
            whole = benchmark._drive(proxy, False, TOKENS, 0.2, 2, False)
        assert streams["bad"] == whole["bad"] == 0  # every answer a 200 with the added logprobs cut
        assert streams["requests"] > 0 and streams["tokens"] == streams["requests"] * TOKENS
        requests.append(streams["requests"] + whole["requests"])
    # Each proxy's tasks in its own log alone: a proxy parses no other proxy's lines.
    assert [log.read_text().count("processing task") for log in logs] == requests
    spans = finished_requests(memory_recorder)
    assert len(spans) == sum(requests) == fake.calls["/v1/chat/completions"]
    assert {attributes[sc.SERVER_TASK_MATCH] for attributes, _, _ in spans} == {sc.TASK_MATCH_MARKER}
    assert fake.calls["/tokenize"] == len(spans)  # each prompt its own: tokenized once each


def test_the_floor_relays_the_fake_server_s_answers_whole():
    """The floor is the relay the proxy's figures are compared with: it must pass every answer on, streams too."""
    fake = benchmark.FakeLlamaServer(TOKENS, 0, [])
    fake.serve()
    listener = socket.create_server(("127.0.0.1", 0))
    upstream = ("127.0.0.1", next(iter(fake.listeners)).getsockname()[1])

    def accept() -> None:
        for _ in range(5):
            client, _ = listener.accept()
            threading.Thread(target=benchmark._floor_connection, args=(client, upstream), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    floor = f"http://127.0.0.1:{listener.getsockname()[1]}"
    relayed = benchmark._drive(floor, False, TOKENS, 0.2, 2, False)
    assert relayed["bad"] == 0 and relayed["requests"] == fake.calls["/v1/chat/completions"] > 0
    streamed = benchmark._drive(floor, True, TOKENS, 0.2, 2, False)  # passed on chunk by chunk
    assert streamed["bad"] == 0 and streamed["requests"] > 0 and streamed["tokens"] == streamed["requests"] * TOKENS
    with socket.create_connection(listener.getsockname()) as sock:
        sock.sendall(benchmark._request(False, TOKENS, 1))
        answer = b""
        while not benchmark._whole_done(bytearray(answer)):
            answer += sock.recv(1 << 16)
    listener.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n" + benchmark.whole_answer(False))
