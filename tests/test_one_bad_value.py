"""One client's bad value costs nothing but that value: a model name with a lone surrogate and a turn
no Int32 holds travel in one batch with 100 good requests, through the real recorder, spool and
ingest; all 102 are stored, the two values repaired and counted, and the books balance."""

from __future__ import annotations

import json

import pytest

from kvtrace import correlate, semconv
from kvtrace.cli import main
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.config import Settings
from kvtrace.errors import BadSetting
from kvtrace.recording.exporters.spool import SpoolExporter
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.stats import lost, read_stats, span_totals


def _request(recorder, turn, model="tiny"):
    with correlate(run_id="mixed", episode_id="e0", turn=turn):
        record = recorder.start_request("test_engine", model=model)
    record.prompt_token_ids = [1, 2, 3, 4]
    record.prompt_tokens = 4
    record.add_token(7, 7, 8, 0.5, -0.1)
    recorder.finish(record)
    return record


def test_a_lone_surrogate_and_an_out_of_range_turn_cost_no_other_request(spool_dir, monkeypatch, capsys):
    # A delay longer than the test: nothing leaves the queue before the flush, so all go in one batch.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    good = [_request(recorder, turn) for turn in range(50)]
    surrogate = _request(recorder, 50, model="bad\ud800model")
    huge_turn = _request(recorder, 2**70)
    good += [_request(recorder, turn) for turn in range(51, 101)]
    recorder.pipeline.force_flush()
    recorder.shutdown()

    (spool_file,) = spool_dir.glob("*.jsonl")
    assert len(spool_file.read_bytes().splitlines()) == 1  # one batch, one line: it held all 102

    totals = span_totals(read_stats(spool_dir))
    assert totals["spans_finished"] == 102 == totals["spans_stored"] + totals["spans_spooled"] + lost(totals)
    assert (totals["spans_spooled"], lost(totals), totals["values_repaired"]) == (102, 0, 2)

    assert main(["db", "ingest", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["spans"], report["quarantined"]) == (102, 0)
    client = _client()
    try:
        rows = dict(client.query("SELECT SpanId, tuple(turn, model) FROM kvtrace_requests").result_rows)
    finally:
        client.close()
    assert len(rows) == 102
    assert all(rows[r.span_id] == (r.correlation.turn, "tiny") for r in good)
    assert rows[surrogate.span_id] == (50, "bad\ufffdmodel")
    assert rows[huge_turn.span_id] == (-1, "tiny")  # the turn left out: the configured default stands

    assert main(["db", "status", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["span_counters"]["values_repaired"] == 2


def test_a_turn_outside_int32_in_the_environment_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setenv("KVTRACE_TURN", str(2**31))
    with pytest.raises(BadSetting, match="KVTRACE_TURN.*at most 2147483647"):
        Settings.from_env()


def test_an_old_spool_line_with_a_turn_outside_int64_keeps_its_other_requests(db, tmp_path):
    # What an earlier kvtrace wrote for the same batch: the turn as it came, in a line of three requests.
    recorder_line = {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{
        "scope": {"name": semconv.INSTRUMENTATION_SCOPE, "version": "0"},
        "spans": [_span(i, str(2**70) if i == 1 else str(i)) for i in range(3)]}]}]}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(recorder_line) + "\n")

    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")

    assert (report.spans, report.quarantined, report.repaired) == (3, 0, 1)
    assert sorted(r[0] for r in db.query("SELECT turn FROM kvtrace_requests").result_rows) == [-1, 0, 2]


def _span(i: int, turn: str) -> dict:
    start = 1_700_000_000_000_000_000 + i
    return {"traceId": "%032x" % (i + 1), "spanId": "%016x" % (i + 1), "name": semconv.SPAN_REQUEST, "kind": 1,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 10),
            "attributes": [{"key": semconv.RUN_ID, "value": {"stringValue": "old"}},
                           {"key": semconv.TURN, "value": {"intValue": turn}}]}


def _client():
    from kvtrace.db import connect

    return connect()
