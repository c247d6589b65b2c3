"""``kvtrace proxy`` in front of a server kvtrace traces from inside (``kvtrace run -- python -m
llama_cpp.server``).

The story: an operator put the proxy in front of a server before tracing the server itself. Both
now record each request; the server's span is the proxy span's child in the client's trace (the
proxy sends its own span as the parent), with the cache provenance only the engine knows, and the
saved queries count every request once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("h11")
pytest.importorskip("llama_cpp.server.app")

from kvtrace.experiment.server import wait_until_healthy  # noqa: E402
from llama_server_process import free_port, running_proxy  # noqa: E402

RUN_ID = "behind-the-proxy"
TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4736"


@contextlib.contextmanager
def llama_cpp_server(tiny_gguf, log_path: Path, *wrapper: str, env=None) -> Iterator[str]:
    """``python -m llama_cpp.server`` on the tiny model (behind ``wrapper``, e.g. ``kvtrace run --``), its base
    URL once it answers; stopped with SIGINT (graceful: a traced server's recorder flushes at exit)."""
    port = free_port()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [*wrapper, sys.executable, "-m",
             "llama_cpp.server", "--model", str(tiny_gguf), "--host", "127.0.0.1", "--port", str(port),
             "--n_ctx", "512", "--n_batch", "64", "--n_ubatch", "64", "--n_threads", "1", "--n_threads_batch", "1",
             "--verbose", "false"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    upstream = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(upstream, server, 90, path="/v1/models"):
            pytest.fail(f"server did not start:\n{log_path.read_text()[-3000:]}")
        yield upstream
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def test_a_traced_server_behind_the_proxy_records_each_request_once_as_the_proxy_spans_child(
        tiny_gguf, spool_dir, db, tmp_path):
    from kvtrace import queries
    from kvtrace.collectors.ingest import ingest_paths

    with llama_cpp_server(tiny_gguf, tmp_path / "server.log", str(Path(sys.executable).parent / "kvtrace"), "run",
                          "--capture", "ids", "--", env=dict(os.environ, KVTRACE_SPOOL_DIR=str(spool_dir))) as upstream:
        with running_proxy(upstream) as proxy:  # the process recorder: this test's spool
            for turn in range(2):
                answer = httpx.post(proxy + "/v1/completions", timeout=120, json={
                    "prompt": "The kitchen has a long oak table and", "max_tokens": 6, "temperature": 0},
                    headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01",
                             "baggage": f"kvtrace.run_id={RUN_ID},kvtrace.episode_id=kitchen,kvtrace.turn={turn}"})
                assert answer.status_code == 200

    ingest_paths(db, [spool_dir])
    spans = db.query("SELECT turn, engine, SpanId, ParentSpanId, TraceId FROM kvtrace_requests "
                     "WHERE run_id = {run:String} ORDER BY turn, engine", parameters={"run": RUN_ID}).result_rows
    assert [(s[0], s[1]) for s in spans] == [(0, "llama_cpp"), (0, "openai-compatible"),
                                             (1, "llama_cpp"), (1, "openai-compatible")]
    for engine_span, proxy_span in (spans[0:2], spans[2:4]):
        assert engine_span[3] == proxy_span[2]  # the engine's span is the proxy span's child
        assert engine_span[4] == proxy_span[4] == TRACE_ID  # in the client's trace
    columns, rows = queries.run(db, "runs")
    (run,) = [dict(zip(columns, row)) for row in rows if row[0] == RUN_ID]
    assert run["requests"] == 2  # each request once: the engine's record stands for it


def test_shadow_twins_are_refused_for_a_server_with_no_cache_bypass(tiny_gguf, tmp_path, capsys):
    """llama-cpp-python's server has no per-request cache bypass: a twin could not be cold, so
    ``kvtrace proxy --shadow`` says so and exits 2 before it listens."""
    from kvtrace.cli import main

    with llama_cpp_server(tiny_gguf, tmp_path / "server.log") as upstream:
        code = main(["proxy", "--upstream", upstream, "--listen", f"127.0.0.1:{free_port()}", "--shadow", "0.1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "no cache bypass" in err[0] and "Run without --shadow" in err[0], err
