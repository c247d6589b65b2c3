"""What the fault tests share: hostile sinks, host processes, small disks, and the span equation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Iterator, Optional

import pytest

from kvtrace.collectors.ingest import ingest_paths
from kvtrace.recording.stats import lost, read_stats, span_totals

HERE = Path(__file__).parent
RECORD_SPANS = HERE / "record_spans.py"
HOST_EXIT_LIMIT_S = 30
"""A hang detector, not a benchmark: a host that needs longer than this to exit is stuck."""


class BlackHole:
    """A TCP server on 127.0.0.1 that accepts every connection and never reads or answers."""

    def __init__(self) -> None:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._server.settimeout(0.1)
        while not self._stop.is_set():
            try:
                connection, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(connection)
            self.accepted += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for connection in self._held:
            connection.close()
        self._server.close()


class Collector:
    """An OTLP/HTTP receiver on 127.0.0.1 that takes every trace request and counts its spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                collector.spans += sum(len(scope.spans) for resource in request.resource_spans
                                       for scope in resource.scope_spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def refused_port() -> int:
    """A local port nothing listens on (connecting is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sink_env(exporter: str, port: int) -> dict[str, str]:
    """Environment pointing ``exporter`` at 127.0.0.1:``port``."""
    if exporter == "clickhouse":
        return {"KVTRACE_EXPORTER": "clickhouse", "KVTRACE_CLICKHOUSE_URL": f"http://127.0.0.1:{port}/default"}
    if exporter == "otlp":
        return {"KVTRACE_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    raise ValueError(exporter)


@dataclass
class HostRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def warnings(self, text: str) -> list[str]:
        return [line for line in self.stderr.splitlines() if text in line]


def run_host(args: list[str], env: dict[str, str], limit_s: float = HOST_EXIT_LIMIT_S) -> HostRun:
    """Run a host process to its end; fail the test if it has not exited within ``limit_s``."""
    started = time.monotonic()
    try:
        proc = subprocess.run(args, env={**os.environ, **env}, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the host process did not exit within {limit_s} s (hung on its sink?); stderr: {exc.stderr}")
    return HostRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def record_spans(spans: int, env: dict[str, str], tokens: int = 16) -> HostRun:
    """A host that records ``spans`` spans through the process recorder and exits."""
    run = run_host([sys.executable, str(RECORD_SPANS), str(spans), str(tokens)], env)
    assert run.returncode == 0, run.stderr
    return run


def spooled_spans(db, spool_dir: Path, run_id: str) -> int:
    """Ingest the spool into the embedded ClickHouse and count the run's request spans there."""
    if spool_dir.is_dir():
        ingest_paths(db, [spool_dir])
    return int(db.query("SELECT count() FROM kvtrace_requests WHERE run_id = {run:String}",
                        parameters={"run": run_id}).result_rows[0][0])


def assert_every_span_accounted(finished: int, counters: dict[str, int], stored: int, spooled: int) -> None:
    """``finished = stored + spooled + counted lost``, with each side measured where it lands."""
    assert counters["spans_finished"] == finished, counters
    assert counters["spans_stored"] == stored, counters
    assert counters["spans_spooled"] == spooled, (counters, f"{spooled} spans found in the spool")
    assert finished == stored + spooled + lost(counters), counters


def counters_of(spool_dir: Path) -> dict[str, int]:
    """Span counters summed over processes, read as ``kvtrace db status`` reads them."""
    return span_totals(read_stats(spool_dir))


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _mount(args: list[str]) -> Optional[str]:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount exited {proc.returncode}")


@contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``path`` (read-only if asked): a small or unwritable disk.

    Needs mount privileges; without them the test is skipped with the reason (failed under CI=true).
    """
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    error = _mount(["-t", "tmpfs", "-o", options, "tmpfs", str(path)])
    if error:
        message = f"cannot mount a tmpfs here ({error}); the test needs root or CAP_SYS_ADMIN"
        if under_ci():
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
