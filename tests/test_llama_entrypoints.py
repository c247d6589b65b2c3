"""Turning instrumentation on without touching the user's code.

``opentelemetry-instrument python app.py``, ``kvtrace run -- python app.py``
and ``KvtraceInstrumentor().instrument()`` must all end with request spans in
the spool; an unsupported llama-cpp-python is refused with a message, never
a crash.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace import semconv as sc

VENV_BIN = Path(sys.executable).parent

APP = """
import sys
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1, n_threads_batch=1,
                      verbose=False)
print(llm.create_completion("hello from the app", max_tokens=3, temperature=0.0)["choices"][0]["text"])
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


def spooled_request_spans(spool_dir: Path) -> list[dict]:
    """Request spans in a spool directory (OTLP/JSON lines), attributes flattened."""
    spans = []
    for path in sorted(spool_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            for resource_spans in json.loads(line)["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        if span["name"] != sc.SPAN_REQUEST:
                            continue
                        attrs = {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}
                        spans.append({**span, "attrs": attrs})
    return spans


def child_env(spool_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(KVTRACE_SPOOL_DIR=str(spool_dir), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
               OTEL_LOGS_EXPORTER="none", **extra)
    return env


@pytest.fixture
def app(tmp_path):
    path = tmp_path / "app.py"
    path.write_text(APP)
    return path


def test_opentelemetry_instrument_records_requests(app, tiny_gguf, spool_dir):
    result = subprocess.run([str(VENV_BIN / "opentelemetry-instrument"), sys.executable, str(app), str(tiny_gguf)],
                            env=child_env(spool_dir), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (span,) = spooled_request_spans(spool_dir)
    assert span["attrs"][sc.ENGINE_NAME] == "llama_cpp"
    assert int(span["attrs"][sc.CACHE_RECOMPUTED_TOKENS]) > 0  # OTLP/JSON carries int64 as a string


def test_kvtrace_run_instruments_and_keeps_exit_code_and_host_sitecustomize(app, tiny_gguf, spool_dir, tmp_path):
    host_hooks = tmp_path / "host-hooks"
    host_hooks.mkdir()
    (host_hooks / "sitecustomize.py").write_text("import os\nos.environ['HOST_SITECUSTOMIZE_RAN'] = '1'\n")
    app.write_text(APP.replace("import sys\n", "import sys, os\nassert os.environ.get('HOST_SITECUSTOMIZE_RAN')\n",
                               1))
    env = child_env(spool_dir, PYTHONPATH=str(host_hooks))
    result = subprocess.run([str(VENV_BIN / "kvtrace"), "run", "--run-id", "wrapped-run", "--", sys.executable,
                             str(app), str(tiny_gguf), "3"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    (span,) = spooled_request_spans(spool_dir)
    assert span["attrs"][sc.RUN_ID] == "wrapped-run"


def test_kvtrace_run_reports_a_missing_command(spool_dir):
    result = subprocess.run([str(VENV_BIN / "kvtrace"), "run", "--", "no-such-command-kvtrace"],
                            env=child_env(spool_dir), capture_output=True, text=True, timeout=60)
    assert result.returncode == 127
    assert "command not found" in result.stderr
    result = subprocess.run([str(VENV_BIN / "kvtrace"), "run"], env=child_env(spool_dir), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2


def test_instrumentor_manual_path(memory_recorder, make_llama, finished_requests):
    from kvtrace.instrumentor import KvtraceInstrumentor
    from kvtrace.patches import llama_cpp as patch

    instrumentor = KvtraceInstrumentor()
    assert instrumentor._check_dependency_conflicts() is None  # llama-cpp-python satisfies "any of"
    instrumentor.instrument()
    try:
        import llama_cpp  # noqa: F401  (already imported: the lazy hook fires at once)

        make_llama().create_completion("instrumentor", max_tokens=2, temperature=0.0)
    finally:
        instrumentor.uninstrument()
    assert len(finished_requests(memory_recorder)) == 1
    assert not patch.HOOKS.active


def test_unsupported_version_is_refused_with_a_message(monkeypatch, caplog, memory_recorder, make_llama,
                                                       finished_requests):
    from kvtrace.patches import llama_cpp as patch

    patch.unpatch()
    monkeypatch.setattr(patch, "get_version", lambda: "0.2.90")
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        assert patch.patch() is False
    assert "0.2.90 is not supported" in caplog.text
    make_llama().create_completion("untraced", max_tokens=2, temperature=0.0)
    assert finished_requests(memory_recorder) == []
    assert patch.supported_versions() == {"llama-cpp-python": ">=0.3.30,<0.4"}
