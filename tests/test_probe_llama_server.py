"""``kvtrace probe`` against a stock llama-cpp-python server that kvtrace does not instrument.

The canary story: an operator points the probe at a running server with two prompts (one chat,
one plain completion).  Each prompt gets a cold request (after a flush request: this server has
no per-request cache bypass) and a warm one; both land as kvtrace spans, the warm one marked as
served from the prefix cache (assumed: the server reports no cached-token count), and the
margin_shift query — the one alert rules use — compares them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from kvtrace import semconv as sc
from kvtrace.cli import main
from kvtrace.experiment.server import stop_server

pytest.importorskip("llama_cpp.server.app")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def plain_server(tiny_gguf, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(tiny_gguf), "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", "512", "--n_batch", "64", "--n_ubatch", "64", "--n_threads", "1",
             "--n_threads_batch", "1", "--verbose", "false"],
            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{base}/models", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    yield base
    stop_server(process)


def test_probe_records_cold_and_warm_spans_that_margin_shift_compares(plain_server, tmp_path, db, spool_dir,
                                                                       capsys):
    from kvtrace import queries
    from kvtrace.collectors.ingest import ingest_paths

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Describe the kitchen in detail"}]}) + "\n"
        + "# plain completion\n"
        + json.dumps({"id": "plain", "prompt": "Once upon a time in a quiet village"}) + "\n")
    code = main(["-q", "probe", "--url", plain_server, "--prompts", str(prompts), "--run-id", "canary",
                 "--warm", "1", "--max-tokens", "6", "--weight-format", "F32"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "no per-request cache bypass" in captured.err
    assert "chat warm#1 vs cold" in captured.out and "plain warm#1 vs cold" in captured.out

    ingest_paths(db, [spool_dir])
    rows = db.query(
        "SELECT episode_id, turn, engine, operation, reused_tokens, prompt_tokens, cache_layer, length(token_ids), "
        "length(margins), SpanAttributes['kvtrace.probe.role'], SpanAttributes['kvtrace.cache.reused_tokens.source'], "
        "prompt_hash, arrayMin(margins) "
        "FROM kvtrace_requests INNER JOIN otel_traces USING (SpanId) WHERE run_id = 'canary' "
        "ORDER BY episode_id, turn").result_rows
    assert [(r[0], r[1], r[9]) for r in rows] == [("chat", 0, "cold"), ("chat", 1, "warm"),
                                                   ("plain", 0, "cold"), ("plain", 1, "warm")]
    for cold, warm in (rows[0:2], rows[2:4]):
        assert cold[2] == warm[2] == "llama_cpp"
        assert (cold[4], cold[6]) == (0, sc.LAYER_NONE)
        assert warm[4] == warm[5] > 0 and warm[6] == sc.LAYER_KV_REUSE
        assert cold[10] == warm[10] == sc.REUSED_SOURCE_ASSUMED
        assert cold[11] == warm[11]  # one prompt, one hash
        assert cold[7] == cold[8] == 6 and warm[7] == warm[8] == 6
        assert cold[12] >= 0
    assert (rows[0][3], rows[2][3]) == (sc.OPERATION_CHAT, sc.OPERATION_TEXT_COMPLETION)

    columns, shift = queries.run(db, "margin_shift", {"run_prefix": "canary"})
    by_format = {row[0]: dict(zip(columns, row)) for row in shift}
    assert by_format["F32"]["request_pairs"] == 2 and by_format["F32"]["positions"] > 0
    assert by_format["F32"]["max_abs_shift"] >= 0
