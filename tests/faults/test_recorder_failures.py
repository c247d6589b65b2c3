"""A recorder that cannot be created: refused before the engine starts, or logged, counted and untraced inside it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sink_faults import counters_of, run_host

KVTRACE = [sys.executable, "-m", "kvtrace.cli"]

# (environment, what the one-line message must name)
BAD_SETTINGS = [
    ({"KVTRACE_CAPTURE": "bogus"}, "KVTRACE_CAPTURE='bogus' is not one of ids, hashed, none"),
    ({"KVTRACE_EXPORTER": "kafka"}, "KVTRACE_EXPORTER='kafka' is not one of"),
    ({"KVTRACE_EXPORTER": "clickhouse", "KVTRACE_CLICKHOUSE_URL": "chdb:///tmp/db"}, "needs KVTRACE_CLICKHOUSE_URL"),
    ({"KVTRACE_EXPORTER": "clickhouse", "KVTRACE_CLICKHOUSE_URL": "http://host:port/db"}, "ClickHouse server"),
    ({"KVTRACE_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"KVTRACE_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf only"),
    ({"KVTRACE_SPOOL_ROTATE_BYTES": "0"}, "KVTRACE_SPOOL_ROTATE_BYTES='0' is too small: it must be at least 16384"),
    ({"KVTRACE_SPOOL_ROTATE_BYTES": "-5"}, "KVTRACE_SPOOL_ROTATE_BYTES='-5' is too small"),
    ({"KVTRACE_SPOOL_ROTATE_BYTES": "64MB"}, "KVTRACE_SPOOL_ROTATE_BYTES='64MB' is not a whole number"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE='0' is too small"),
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"}, "larger than the queue"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "0"}, "OTEL_BSP_SCHEDULE_DELAY='0' is too small"),
    ({"OTEL_BSP_EXPORT_TIMEOUT": "nan"}, "OTEL_BSP_EXPORT_TIMEOUT='nan' is not a positive number of milliseconds"),
    ({"KVTRACE_CONNECT_TIMEOUT": "-1"}, "KVTRACE_CONNECT_TIMEOUT='-1' is not a positive number"),
    ({"KVTRACE_SHUTDOWN_TIMEOUT": "inf"}, "KVTRACE_SHUTDOWN_TIMEOUT='inf' is not a positive number"),
    ({"KVTRACE_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "10s"}, "OTEL_EXPORTER_OTLP_TIMEOUT='10s'"),
    ({"KVTRACE_BLOCK_SIZE": "0"}, "KVTRACE_BLOCK_SIZE='0' is too small"),
    ({"KVTRACE_HASH_KEY": "short-key"}, "KVTRACE_HASH_KEY is 9 bytes long; a hash key needs at least 16"),
    # Directories that cannot be written (a path under a file: no permission bits, so root is refused too).
    ({"XDG_DATA_HOME": "/dev/null/data", "KVTRACE_HASH_KEY": ""}, "cannot keep the hash key in the data home"),
    ({"KVTRACE_SPOOL_DIR": "/dev/null/spool"}, "the spool directory /dev/null/spool cannot be written"),
]


@pytest.mark.parametrize("bad, message", BAD_SETTINGS, ids=[" ".join(f"{k}={v}" for k, v in b.items()) for b, _ in BAD_SETTINGS])
def test_kvtrace_run_refuses_a_setting_the_engine_could_not_record_with(bad, message, tmp_path):
    marker = tmp_path / "engine-started"
    run = run_host([*KVTRACE, "run", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"], bad)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    assert not marker.exists()  # refused before the command ran


@pytest.mark.parametrize("bad, message", [BAD_SETTINGS[0], BAD_SETTINGS[-2]], ids=["capture", "data home"])
def test_selfcheck_refuses_them_too(bad, message):
    run = run_host([*KVTRACE, "selfcheck", "--requests", "1"], bad)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


ENGINE = """
import sys
import kvtrace
kvtrace.instrument(["llama_cpp"])
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1, n_threads_batch=1, seed=3,
                      verbose=False)
for prompt in ("one", "two", "three"):
    print(llm.create_completion(prompt, max_tokens=4, temperature=0.0)["choices"][0]["text"].encode().hex())
"""


def test_inside_a_running_engine_a_bad_setting_is_logged_once_counted_and_the_engine_runs_untraced(
        tiny_gguf, spool_dir, tmp_path):
    app = tmp_path / "engine.py"
    app.write_text(ENGINE)
    # The engine was started some other way than `kvtrace run` (vLLM's plugin, opentelemetry-instrument).
    untraced = run_host([sys.executable, str(app), str(tiny_gguf)], {"KVTRACE_DISABLED": "1"}, limit_s=120)
    traced = run_host([sys.executable, str(app), str(tiny_gguf)], {"KVTRACE_CAPTURE": "bogus"}, limit_s=120)
    assert traced.returncode == 0 and untraced.returncode == 0, traced.stderr
    assert traced.stdout == untraced.stdout  # three completions, exactly what the engine computes alone
    warnings = traced.warnings("tracing is off in this process")
    assert len(warnings) == 1 and "KVTRACE_CAPTURE='bogus'" in warnings[0], traced.stderr
    assert not list(spool_dir.glob("*.jsonl"))  # untraced: no spans

    assert counters_of(spool_dir)["recorder_failures"] == 1
    status = subprocess.run([*KVTRACE, "db", "status", "--format", "json"], capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["span_counters"]["recorder_failures"] == 1
    (process,) = report["processes"]
    assert "KVTRACE_CAPTURE" in process["error"]
