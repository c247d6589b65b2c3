"""Each typed table is declared once (collectors/tables.py): a column added there is in the table, in the
view that fills it from a Collector's rows, and in the rows ingest writes, with no other file changed."""

from __future__ import annotations

import json

from kvtrace import semconv as sc
from kvtrace.collectors import tables
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.otlp_rows import COLUMNS, rows_from_request
from kvtrace.collectors.schema import init_schema
from kvtrace.collectors.store import typed_table
from kvtrace.db import connect

QUEUE_DEPTH = "kvtrace.test.queue_depth"


def with_queue_depth() -> tables.Table:
    """``kvtrace_requests`` with one more column, right after ``finish_reason``, from an attribute's text."""
    columns = list(tables.REQUESTS.columns)
    at = [c.name for c in columns].index("finish_reason") + 1
    columns.insert(at, tables.attribute("queue_depth", "UInt32", QUEUE_DEPTH))
    return tables.REQUESTS._replace(columns=tuple(columns))


def request_line(depth: str) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "1" * 32, "spanId": "2" * 16, "name": sc.SPAN_REQUEST,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000000000010",
        "attributes": [{"key": sc.RUN_ID, "value": {"stringValue": "declared"}},
                       {"key": QUEUE_DEPTH, "value": {"stringValue": depth}}]}]}]}]})


def test_a_column_added_to_a_declaration_is_in_the_ddl_the_view_and_the_writer():
    declared = with_queue_depth()
    ddl = tables.create_table(declared)
    assert "    finish_reason LowCardinality(String),\n    queue_depth UInt32,\n    status_code" in ddl
    view = tables.create_view(declared)
    assert f"    toUInt32OrZero(SpanAttributes['{QUEUE_DEPTH}']) AS queue_depth,\n" in view
    assert "queue_depth" not in tables.create_table(tables.REQUESTS) + tables.create_view(tables.REQUESTS)

    rows = rows_from_request(request_line("7"), typed=True)
    written = typed_table(declared, rows)
    assert written.column_names == [c.name for c in declared.columns if c.origin != tables.MATERIALIZED]
    assert written.column("queue_depth").to_pylist() == [7]


def test_a_column_added_to_the_cache_events_reads_its_event_attribute_in_the_view_and_the_writer():
    columns = (*tables.CACHE_EVENTS.columns, tables.Column("hit_blocks", "UInt32", tables.EVENT_ATTRIBUTE, QUEUE_DEPTH))
    declared = tables.CACHE_EVENTS._replace(columns=columns)
    assert tables.create_table(declared).endswith("    source_time_unix_nano UInt64,\n    hit_blocks UInt32\n"
                                                  ") ENGINE = ${span_engine}\nPARTITION BY toDate(Timestamp)\n"
                                                  "ORDER BY (run_id, episode_id, turn, Timestamp, TraceId, SpanId, "
                                                  "event_index)\n")
    assert f"    toUInt32OrZero(ea['{QUEUE_DEPTH}']) AS hit_blocks\nFROM" in tables.create_view(declared)

    line = json.loads(request_line("5"))
    span = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["events"] = [{"name": sc.EVENT_CACHE_LOOKUP, "timeUnixNano": "1700000000000000001",
                       "attributes": [{"key": QUEUE_DEPTH, "value": {"intValue": "3"}}]},
                      {"name": "not.a.cache.event", "timeUnixNano": "1700000000000000002"}]
    written = typed_table(declared, rows_from_request(json.dumps(line), typed=True))
    assert written.column("hit_blocks").to_pylist() == [3]
    assert written.column("event").to_pylist() == [sc.EVENT_CACHE_LOOKUP]


def test_both_paths_store_a_column_added_to_a_declaration(monkeypatch, tmp_path):
    monkeypatch.setattr(tables, "TYPED_TABLES", (with_queue_depth(), tables.CACHE_EVENTS))
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "spans.jsonl").write_text(request_line("42") + "\n")
    stored = {}
    for path in ("ingested", "collector"):
        client = connect(f"chdb://{tmp_path / path}")
        init_schema(client)
        if path == "ingested":
            assert ingest_paths(client, [spool], quarantine_dir=tmp_path / "q").spans == 1
        else:  # as a Collector's exporter writes it: attributes as text, the view does the rest
            client.insert("otel_traces", rows_from_request(request_line("42")), column_names=COLUMNS)
        stored[path] = client.query("SELECT run_id, queue_depth FROM kvtrace_requests FINAL").result_rows
        client.close()
    assert stored["ingested"] == stored["collector"] == [("declared", 42)]
