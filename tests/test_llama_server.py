"""``kvtrace run -- python -m llama_cpp.server``: a client harness tags requests over HTTP.

The story: an agent harness drives the stock llama-cpp-python server (with
its prompt cache on) and sends W3C ``traceparent`` and ``baggage`` headers
with each request.  Without changing the server, its spans join the
harness's traces, carry run / episode / turn, and — once ingested into
ClickHouse — say which earlier request's cached state served episode A's
second turn after episode B had run in between.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from readme_commands import readme_command

httpx = pytest.importorskip("httpx")
pytest.importorskip("llama_cpp.server.app")

from kvtrace.experiment.server import wait_until_healthy  # noqa: E402  (needs httpx)

RUN_ID = "harness-run-1"
SERVE = "kvtrace run -- python -m llama_cpp.server --model MODEL.gguf --cache true"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headers(trace_id: str, parent_id: str, episode: str, turn: int) -> dict[str, str]:
    return {
        "traceparent": f"00-{trace_id}-{parent_id}-01",
        "baggage": f"kvtrace.run_id={RUN_ID},kvtrace.episode_id={episode},kvtrace.turn={turn}",
    }


@pytest.fixture
def server(tiny_gguf, spool_dir, tmp_path):
    port = free_port()
    env = dict(os.environ, KVTRACE_SPOOL_DIR=str(spool_dir))
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        # README's command (token ids in the clear from the test's KVTRACE_CAPTURE), sized for the tiny model.
        process = subprocess.Popen(
            [*readme_command(SERVE, {"MODEL.gguf": str(tiny_gguf)}), "--host", "127.0.0.1", "--port", str(port),
             "--n_ctx", "512", "--n_batch", "64", "--n_ubatch", "64", "--n_threads", "1", "--n_threads_batch", "1",
             "--verbose", "false"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    if not wait_until_healthy(base, process, 90, path="/v1/models"):
        process.kill()
        pytest.fail(f"server did not start:\n{log_path.read_text()[-3000:]}")

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # graceful: the recorder flushes at exit
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    yield base, stop
    stop()


def chat(base: str, messages: list[dict], hdrs: dict[str, str], stream: bool = False) -> str:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.0, "stream": stream}
    if not stream:
        response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=hdrs, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]
    import json

    text = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=hdrs, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def test_server_spans_join_the_harness_trace_and_name_the_cache_source(server, db, spool_dir):
    from kvtrace.collectors.ingest import ingest_paths

    base, stop = server
    ids = {
        ("A", 0): ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),
        ("B", 0): ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"),
        ("A", 1): ("0af7651916cd43dd8448eb211c80319c", "c0ffee0000000001"),  # same episode trace, new parent
    }
    history_a = [{"role": "user", "content": "Episode A: describe the kitchen in detail"}]
    reply = chat(base, history_a, headers(*ids[("A", 0)], "A", 0))
    chat(base, [{"role": "user", "content": "Episode B: a different topic entirely"}],
         headers(*ids[("B", 0)], "B", 0), stream=True)
    history_a += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    chat(base, history_a, headers(*ids[("A", 1)], "A", 1), stream=True)
    chat(base, [{"role": "user", "content": "no headers at all"}], {})
    stop()

    report = ingest_paths(db, [spool_dir])
    assert report is not None
    rows = db.query(
        "SELECT run_id, episode_id, turn, TraceId, ParentSpanId, SpanId, cache_layer, reused_tokens, "
        "source_span_id, source_episode_id, source_turn, length(token_ids), length(margins), operation "
        "FROM kvtrace_requests ORDER BY Timestamp").result_rows
    assert len(rows) == 4
    a0, b0, a1, anonymous = rows
    for row, key in ((a0, ("A", 0)), (b0, ("B", 0)), (a1, ("A", 1))):
        assert (row[0], row[1], row[2]) == (RUN_ID, key[0], key[1])
        assert (row[3], row[4]) == ids[key]  # the harness's trace id and parent span
        assert row[11] == row[12] > 0 and row[13] == "chat"
    assert anonymous[0].startswith("run-") and anonymous[1] == "" and anonymous[3] not in {t for t, _ in ids.values()}

    # A's second turn came back after B: served from the prompt cache with the state A's first turn stored.
    assert a1[6] == "prompt_cache" and a1[7] > 0
    assert (a1[8], a1[9], a1[10]) == (a0[5], "A", 0)
    events = db.query(
        "SELECT event, outcome, source_span_id FROM kvtrace_cache_events WHERE SpanId = {span:String} "
        "ORDER BY event_index", parameters={"span": a1[5]}).result_rows
    assert ("kvtrace.cache.lookup", "hit", a0[5]) in events
    assert ("kvtrace.cache.restore", "", a0[5]) in events
