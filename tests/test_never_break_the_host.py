"""A slow, dead or failing sink never blocks or raises into the engine; what is lost is counted."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.config import Settings
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.exporters.spool import SpoolExporter
from kvtrace.recording.stats import read_stats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_request(recorder, tokens=8):
    rec = recorder.start_request("test_engine")
    for i in range(tokens):
        rec.add_token(i, i, i + 1, 0.5, -0.1)
    recorder.finish(rec)


def test_dead_clickhouse_falls_back_to_the_spool_and_the_call_returns(monkeypatch, spool_dir):
    monkeypatch.setenv("KVTRACE_EXPORTER", "clickhouse")
    monkeypatch.setenv("KVTRACE_CLICKHOUSE_URL", f"http://127.0.0.1:{_free_port()}")
    recorder = Recorder(Settings.from_env())
    for _ in range(3):
        _one_request(recorder)
    assert recorder.pipeline.force_flush(30000)
    recorder.shutdown()
    assert recorder.pipeline.counters["spans_spooled"] == 3
    assert recorder.pipeline.counters["spans_spooled_fallback"] == 3
    lines = [json.loads(l) for f in spool_dir.glob("*.jsonl") for l in f.read_text().splitlines()]
    spans = [s for l in lines for rs in l["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert len(spans) == 3
    stats = read_stats(spool_dir)
    assert stats and stats[0]["spans_spooled_fallback"] == 3


class _BlockedExporter(SpanExporter):
    """An exporter stuck until released (a hung collector)."""

    def __init__(self):
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.release.wait()
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def test_a_hung_exporter_never_blocks_the_engine_and_overflow_is_counted(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "5")
    exporter = _BlockedExporter()
    recorder = Recorder(Settings.from_env(), exporter=exporter)
    done = threading.Event()

    def engine():
        for _ in range(100):
            _one_request(recorder)
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    # The engine thread finishes its 100 requests while the exporter is still stuck.
    assert done.wait(60), "recording blocked on a hung exporter"
    counters = recorder.pipeline.counters.snapshot()
    # At most one batch in flight plus a full queue got through; the rest are counted, not lost silently.
    assert counters["spans_dropped_queue_full"] >= 100 - 10 - 5
    assert counters["spans_queued"] + counters["spans_dropped_queue_full"] == 100
    exporter.release.set()
    recorder.shutdown()
    assert exporter.exported == counters["spans_queued"]


class _RaisingExporter(SpanExporter):
    def export(self, spans):
        raise RuntimeError("collector exploded")


def test_an_exporter_that_raises_is_counted_and_nothing_reaches_the_engine():
    recorder = Recorder(Settings.from_env(), exporter=_RaisingExporter())
    _one_request(recorder)
    assert recorder.pipeline.force_flush(10000)
    assert recorder.pipeline.counters["spans_failed_export"] == 1
    recorder.shutdown()


def test_a_broken_record_is_counted_not_raised(spool_recorder):
    rec = spool_recorder.start_request("test_engine")
    rec.correlation = None        # a patch bug: the record cannot be turned into a span
    spool_recorder.finish(rec)    # must not raise; the span is built on the pipeline's thread
    ok = spool_recorder.start_request("test_engine")
    spool_recorder.finish(ok)
    assert spool_recorder.pipeline.force_flush()
    counters = spool_recorder.pipeline.counters
    assert counters["instrumentation_errors"] == 1
    # Accounted for: finished = stored + spooled + lost, the broken one lost, the next one spooled.
    assert (counters["spans_finished"], counters["spans_spooled"], counters["spans_failed_export"]) == (2, 1, 1)


def test_one_spool_file_per_process_and_rotation(spool_dir):
    exporter = SpoolExporter(spool_dir, rotate_bytes=2000)
    recorder = Recorder(Settings.from_env(), exporter=exporter)
    for _ in range(20):
        _one_request(recorder, tokens=30)
        recorder.pipeline.force_flush()
    recorder.shutdown()
    files = sorted(spool_dir.glob("*.jsonl"))
    assert len(files) > 1
    assert len({f.name.rsplit("-", 1)[0] for f in files}) == 1  # one process tag, several sequence numbers
    assert all(f.read_bytes().endswith(b"\n") for f in files)
    assert sum(len(f.read_text().splitlines()) for f in files) == 20


def test_a_busy_embedded_database_says_who_holds_it_and_what_to_do(tmp_path):
    import subprocess
    import sys

    from kvtrace.db import connect
    from kvtrace.errors import DatabaseBusy

    path = tmp_path / "busy-db"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from kvtrace.db import connect; c = connect(sys.argv[1]); "
         "print('open', flush=True); time.sleep(60)", f"chdb://{path}"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(DatabaseBusy) as info:
            connect(f"chdb://{path}")
        message = str(info.value)
        assert str(path) in message and f"process {holder.pid}" in message
        assert "--db" in message
    finally:
        holder.kill()
        holder.wait()


def test_counters_survive_an_update_cut_short(spool_dir):
    from kvtrace.recording.stats import SLOT_BYTES, StatsFile, read_stats

    stats = StatsFile.create(spool_dir, "host-1-1")
    stats.publish({"spans_finished": 5, "spans_spooled": 5})
    stats.publish({"spans_finished": 9, "spans_spooled": 9})
    stats.close()
    assert read_stats(spool_dir)[0]["spans_finished"] == 9
    # A crash in the middle of the next update, which goes over the older slot: only its start is new.
    data = bytearray(stats.path.read_bytes())
    torn = b'0badc0de {"seq":4,"spans_finished":12,"spans_spo'
    older = 0 if data[SLOT_BYTES:].find(b'"spans_finished":9') >= 0 else SLOT_BYTES
    data[older:older + len(torn)] = torn
    stats.path.write_bytes(bytes(data))
    (entry,) = read_stats(spool_dir)
    assert entry["spans_finished"] == 9 and entry["spans_spooled"] == 9  # the last whole update
