"""The spool and ingest lose nothing valid: partial lines, crashed writers, corrupt lines, foreign files."""

from __future__ import annotations

import json
import subprocess
import sys

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvtrace.collectors.ingest import ingest_paths
from kvtrace.recording.exporters.otlp_json import encode_request
from kvtrace.recording.exporters.spool import spool_host


def _spans(n, name="tool.call"):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("other-tool", "9.9")
    for i in range(n):
        with tracer.start_as_current_span(name, kind=SpanKind.SERVER, attributes={"i": i, "xs": [1.5, 2.5]}) as s:
            s.add_event("evt", {"k": "v"})
    return exporter.get_finished_spans()


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_file_still_being_written_is_taken_up_to_its_last_line_and_continued(db, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    lines = [encode_request(_spans(1)) for _ in range(3)]
    # Named as the live writer (this process): its tail is "still being written".
    path = spool / f"kvtrace-{spool_host()}-{__import__('os').getpid()}-1-000000.jsonl"
    half = len(lines[2]) // 2
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:half])
    first = ingest_paths(db, [spool])
    assert first.spans == 2 and first.pending_bytes == half and first.quarantined == 0
    with open(path, "a") as f:
        f.write(lines[2][half:] + "\n")
    assert ingest_paths(db, [spool]).spans == 1
    assert db.query("SELECT count() FROM otel_traces").result_rows[0][0] == 3


def test_a_tail_no_writer_can_be_watched_for_waits_and_ingest_says_how_to_end_it(db, tmp_path):
    good = encode_request(_spans(1))
    foreign = tmp_path / "collector-export.jsonl"
    foreign.write_text(good + "\n" + "{garbage")
    elsewhere = tmp_path / "kvtrace-otherhost-123-1-000000.jsonl"  # another machine's spool file
    elsewhere.write_text(good[:20])
    report = ingest_paths(db, [foreign, elsewhere], quarantine_dir=tmp_path / "q")
    assert report.spans == 1 and report.pending_bytes == len("{garbage") + 20 and report.quarantined == 0
    first, second = report.files
    assert len(first.messages) == 1 and first.messages[0].startswith(f"{foreign}: its last 8 byte(s) end in no newline")
    assert "no kvtrace spool file" in first.messages[0] and "end it with a newline" in first.messages[0]
    assert "another machine, otherhost" in second.messages[0]
    with open(foreign, "a") as f:
        f.write("\n")
    again = ingest_paths(db, [foreign], quarantine_dir=tmp_path / "q")
    assert again.spans == 0 and again.quarantined == 1 and again.pending_bytes == 0


def test_truncated_tail_of_a_crashed_writer_is_quarantined_and_the_rest_kept(db, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    path = spool / f"kvtrace-{spool_host()}-{_dead_pid()}-1-000000.jsonl"
    good = encode_request(_spans(2))
    path.write_text(good + "\n" + good[: len(good) // 3])
    report = ingest_paths(db, [spool], quarantine_dir=tmp_path / "q")
    assert report.spans == 2 and report.quarantined == 1
    assert "truncated last line" in report.files[0].messages[0]
    quarantined = [json.loads(l) for l in (tmp_path / "q").glob("*.jsonl").__next__().read_text().splitlines()]
    assert quarantined[0]["line"] == 2 and quarantined[0]["text"] == good[: len(good) // 3]
    assert ingest_paths(db, [spool]).spans == 0  # marked complete: nothing is re-read


def test_corrupt_lines_are_quarantined_with_their_line_numbers(db, tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = [encode_request(_spans(1)) for _ in range(3)]
    path.write_text("\n".join([good[0], "{not json", good[1], '{"resourceLogs": []}', good[2]]) + "\n")
    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")
    assert report.spans == 3 and report.quarantined == 2
    messages = report.files[0].messages
    assert any(":2:" in m for m in messages) and any(":4:" in m for m in messages)


def test_otlp_json_from_another_tool_lands_in_otel_traces(db, tmp_path):
    spans = _spans(2, name="http.request")
    # The generic protobuf JSON mapping (base64 ids, enum names), pretty-printed over many lines.
    document = json_format.MessageToJson(encode_spans(spans))
    assert "\n" in document
    (tmp_path / "export.json").write_text(document)
    # And the Collector file exporter's form: one request per line, hex ids, enum numbers.
    (tmp_path / "collector.jsonl").write_text(encode_request(_spans(1, name="db.query")) + "\n")
    report = ingest_paths(db, [tmp_path / "export.json", tmp_path / "collector.jsonl"])
    assert report.spans == 3 and report.quarantined == 0
    rows = db.query("SELECT SpanName, SpanKind, TraceId, ScopeName, ScopeVersion, SpanAttributes['xs'], "
                    "Events.Name FROM otel_traces ORDER BY SpanName").result_rows
    assert [r[0] for r in rows] == ["db.query", "http.request", "http.request"]
    expected_ids = sorted("%032x" % s.context.trace_id for s in spans)
    assert sorted(r[2] for r in rows if r[0] == "http.request") == expected_ids
    assert all(r[1] == "SPAN_KIND_SERVER" and r[3:5] == ("other-tool", "9.9") for r in rows)
    assert rows[0][5] == "[1.5,2.5]" and rows[0][6] == ["evt"]


def test_a_corrupt_first_line_does_not_hide_the_rest_of_the_file(db, tmp_path):
    path = tmp_path / "first-bad.jsonl"
    path.write_text("{garbage\n" + encode_request(_spans(1)) + "\n" + encode_request(_spans(1)) + "\n")
    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")
    assert report.spans == 2 and report.quarantined == 1


def test_a_resumed_file_reports_its_real_line_numbers(db, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    path = spool / f"kvtrace-{spool_host()}-{__import__('os').getpid()}-2-000000.jsonl"
    path.write_text(encode_request(_spans(1)) + "\n" + encode_request(_spans(1)) + "\n")
    assert ingest_paths(db, [spool]).spans == 2
    with open(path, "a") as f:
        f.write("{broken\n" + encode_request(_spans(1)) + "\n")
    report = ingest_paths(db, [spool], quarantine_dir=tmp_path / "q")
    assert report.spans == 1 and report.quarantined == 1
    assert ":3:" in report.files[0].messages[0]
