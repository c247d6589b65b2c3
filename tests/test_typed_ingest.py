"""A spool ingested with typed arrays and the same spans stored by an OpenTelemetry Collector answer alike.

The spool packs the per-token arrays and `kvtrace db ingest` hands them to kvtrace_requests as numbers;
a Collector's ClickHouse exporter writes the same spans into otel_traces with every array as JSON text,
and the views parse it.  Both must end with the same rows, span for span, in every table the queries
read — and in otel_traces itself.
"""

from __future__ import annotations

import json
import math
import re
import struct

import pytest

from kvtrace import correlate
from kvtrace import semconv as sc
from kvtrace.collectors.ingest import ingest_paths, typed_requests_available
from kvtrace.collectors.otlp_rows import COLUMNS, rows_from_request
from kvtrace.collectors.schema import init_schema
from kvtrace.config import Settings
from kvtrace.db import connect
from kvtrace.recording.exporters.otlp_json import encode_request
from kvtrace.recording.exporters.spool import SpoolExporter
from kvtrace.recording.records import CacheEvent, StateOrigin
from kvtrace.recording.recorder import Recorder

# Doubles that are awkward in text: the smallest subnormal, exponents both ways, a negative zero,
# one ULP above 1, and what Go and Python spell differently (1e-7, 1e21 and up).
AWKWARD = [5e-324, 1e-17, 1e-7, 0.1 + 0.2, -0.0, 1.0, 1e21, 1.5e300, 123456789.123456789,
           struct.unpack("<d", struct.pack("<q", 0x3FF0000000000001))[0]]

TABLES = {
    "kvtrace_requests": "SpanId",
    "kvtrace_tokens": "SpanId, position",
    "kvtrace_cache_events": "SpanId, event_index",
    "otel_traces": "SpanId",
}


def recorded_spans(monkeypatch, tmp_path) -> list:
    """Requests as engines and outside recorders make them, under each capture mode."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = []
    for capture in (sc.CAPTURE_IDS, sc.CAPTURE_HASHED, sc.CAPTURE_NONE):
        monkeypatch.setenv("KVTRACE_CAPTURE", capture)
        memory = InMemorySpanExporter()
        recorder = Recorder(Settings.from_env(), exporter=memory)
        origin = StateOrigin(span_id="00000000000000ab", trace_id="0" * 31 + "1", request_id="req-7",
                             run_id=f"run-{capture}", episode_id="ep0", turn=0, time_unix_nano=1_700_000_000_000_000_000)

        def request(turn, margins, reused=0, events=(), config=None):
            with correlate(run_id=f"run-{capture}", episode_id="ep0", turn=turn):
                rec = recorder.start_request("test_engine", model="tiny")
            rec.prompt_token_ids = list(range(100, 148))
            rec.prompt_tokens = 48
            rec.reused_tokens, rec.recomputed_tokens = reused, 48 - reused
            if reused:
                rec.cache_layer, rec.state_key, rec.state_origin = sc.LAYER_PROMPT_CACHE, "key-1", origin
                rec.hit_block_hashes = ["h1", "h2"]
                rec.block_layers = [sc.LAYER_PROMPT_CACHE, sc.LAYER_NONE, sc.LAYER_NONE]
            for i, margin in enumerate(margins):
                rec.add_token(1000 + i, 1000 + i + (i % 3 == 2), 2000 + i, margin, -abs(margin) / 3 - i)
            rec.events.extend(events)
            rec.config[sc.MODEL_WEIGHT_FORMAT] = "Q4_K_M"
            rec.config[sc.NUMERICS_SETTINGS] = {"n_threads": 1, "n_ubatch": 512}
            rec.config.update(config or {})
            rec.finish_reason = "length"
            recorder.finish(rec)

        restore = CacheEvent(sc.EVENT_CACHE_RESTORE, sc.LAYER_PROMPT_CACHE, key_hash="k1", tokens=32,
                             prefix_tokens=32, block_hashes=["h1", "h2"], block_ids=[3, 4], source=origin)
        request(0, AWKWARD)
        request(1, [0.5 * i for i in range(300)], reused=32, events=[restore])
        request(2, [])  # nothing generated
        request(3, [math.nan, 0.25, math.inf])  # rows without a margin: left to the view on both sides
        # Recorded outside an engine (a probe, an imported log): the *_source columns are filled.
        request(4, [0.75, 2.0], config={sc.PROMPT_HASH_SOURCE: sc.PROMPT_HASH_SOURCE_REQUEST_TEXT,
                                        sc.CACHE_REUSED_TOKENS_SOURCE: sc.REUSED_SOURCE_OPENAI_USAGE,
                                        sc.OUTPUT_TOKEN_ID_SOURCE: sc.TOKEN_ID_SOURCE_TEXT_HASH})
        recorder.pipeline.force_flush()
        spans.extend(memory.get_finished_spans())
        recorder.shutdown()
    return spans


def table_rows(client) -> dict[str, list[dict[str, str]]]:
    """Every row of each table, column name → repr (NaN equals NaN, -0.0 differs from 0.0: bit-exact)."""
    out = {}
    for table, order in TABLES.items():
        result = client.query(f"SELECT * FROM {table} ORDER BY {order}")
        out[table] = [{name: repr(value) for name, value in zip(result.column_names, row)}
                      for row in result.result_rows]
    return out


def differences(a: list[dict], b: list[dict]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} rows against {len(b)}"]
    return [f"row {i} {column}: {x[column][:200]} != {y[column][:200]}"
            for i, (x, y) in enumerate(zip(a, b)) for column in x if x[column] != y[column]]


def database(path):
    client = connect(f"chdb://{path}")
    init_schema(client)
    return client


def test_a_spool_and_a_collector_store_the_same_rows_span_for_span(monkeypatch, tmp_path):
    spans = recorded_spans(monkeypatch, tmp_path)
    spool = tmp_path / "spool"
    SpoolExporter(spool).export(spans)
    written = [json.loads(line) for path in spool.glob("*.jsonl") for line in path.read_text().splitlines()]
    packed = [a for line in written for rs in line["resourceSpans"] for ss in rs["scopeSpans"]
              for span in ss["spans"] for a in span["attributes"] if a["key"] == sc.OUTPUT_MARGINS]
    assert packed and all("bytesValue" in a["value"] for a in packed)  # no value object per token

    # This version's spool, ingested with typed arrays.
    client = database(tmp_path / "from-spool")
    assert typed_requests_available(client)
    report = ingest_paths(client, [spool], quarantine_dir=tmp_path / "q")
    assert (report.spans, report.quarantined) == (len(spans), 0)
    from_spool = table_rows(client)
    client.close()

    # The same spans as standard OTLP, stored the way a Collector's ClickHouse exporter stores them:
    # straight into otel_traces, every array as JSON text for the views to parse.
    client = database(tmp_path / "from-collector")
    client.insert("otel_traces", rows_from_request(json.loads(encode_request(spans))), column_names=COLUMNS)
    from_collector = table_rows(client)
    client.close()

    # A spool of an earlier version (standard arrays), ingested now.
    old_spool = tmp_path / "old-spool"
    old_spool.mkdir()
    (old_spool / "old.jsonl").write_text(encode_request(spans) + "\n")
    client = database(tmp_path / "from-old-spool")
    assert ingest_paths(client, [old_spool], quarantine_dir=tmp_path / "q").spans == len(spans)
    from_old_spool = table_rows(client)
    client.close()

    assert len(from_collector["kvtrace_requests"]) == len(spans) == 15
    assert len(from_collector["kvtrace_tokens"]) == 3 * (len(AWKWARD) + 300 + 3 + 2)
    for table in TABLES:
        assert differences(from_spool[table], from_collector[table]) == [], table
        assert differences(from_old_spool[table], from_collector[table]) == [], table


def test_the_margins_come_back_bit_exact_through_the_typed_path(spool_recorder, spool_dir, db):
    # (A negative zero reads back as 0, as it does through a Collector: its JSON text is "-0".)
    exact = [m for m in AWKWARD if struct.pack("<d", m) != struct.pack("<d", -0.0)]
    with correlate(run_id="exact", episode_id="e", turn=0):
        rec = spool_recorder.start_request("test_engine")
    for i, margin in enumerate(exact):
        rec.add_token(i, i, i + 1, margin, -margin)
    spool_recorder.finish(rec)
    spool_recorder.pipeline.force_flush()

    assert ingest_paths(db, [spool_dir]).spans == 1
    ((margins, logprobs),) = db.query("SELECT margins, logprobs FROM kvtrace_requests").result_rows
    bits = [struct.pack("<d", m) for m in exact]
    assert [struct.pack("<d", m) for m in margins] == bits
    assert [struct.pack("<d", -m) for m in logprobs] == bits


@pytest.mark.parametrize("spoil, reason", [
    ("AAAA", "not base64 of whole 8-byte numbers"),    # 3 bytes: not one whole int64
    ("not base64!", "not base64 of whole 8-byte numbers"),
])
def test_a_packed_array_that_does_not_unpack_is_quarantined_with_its_line(spool_recorder, spool_dir, db, tmp_path,
                                                                          spoil, reason):
    with correlate(run_id="spoiled", episode_id="e", turn=0):
        rec = spool_recorder.start_request("test_engine")
    rec.add_token(1, 1, 2, 0.5, -0.5)
    spool_recorder.finish(rec)
    spool_recorder.pipeline.force_flush()
    (path,) = spool_dir.glob("*.jsonl")
    line = json.loads(path.read_text())
    for attribute in line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]:
        if attribute["key"] == sc.OUTPUT_TOKEN_IDS:
            attribute["value"] = {"bytesValue": spoil}
    path.write_text(json.dumps(line) + "\n" + path.read_text())

    report = ingest_paths(db, [spool_dir], quarantine_dir=tmp_path / "q")
    assert (report.spans, report.quarantined) == (1, 1)
    assert any(f"{path}:1:" in m and reason in m for m in report.messages)


def test_a_database_made_before_typed_ingest_uses_the_json_view_until_its_upgrade_points_it_further(
        spool_recorder, spool_dir, db, tmp_path):
    # As schema version 2 made it: the JSON view does not know to pass typed spans over.
    view = db.query("SELECT as_select FROM system.tables WHERE name = 'kvtrace_requests_mv'").result_rows[0][0]
    earlier = re.sub(r"\s*AND\s*\(?getSetting\('log_comment'\)\s*!=\s*'[^']*'\)?", "", view)
    assert earlier != view
    db.command(f"ALTER TABLE kvtrace_requests_mv MODIFY QUERY {earlier}")
    db.command("ALTER TABLE kvtrace_schema_migrations DELETE WHERE version = 3", settings={"mutations_sync": 1})
    for turn in range(2):
        with correlate(run_id="before", episode_id="e", turn=turn):
            rec = spool_recorder.start_request("test_engine")
        rec.add_token(1, 1, 2, 0.5, -0.5)
        spool_recorder.finish(rec)
        spool_recorder.pipeline.force_flush()
        if turn == 0:
            # Ingest sees the view as it is and stores through it alone: one request row, not two.
            assert not typed_requests_available(db)
            assert ingest_paths(db, [spool_dir], quarantine_dir=tmp_path / "q").spans == 1
            assert init_schema(db).applied == ("0003_typed_request_arrays",)
            assert typed_requests_available(db)
    assert ingest_paths(db, [spool_dir], quarantine_dir=tmp_path / "q").spans == 1
    assert db.query("SELECT turn, count() FROM kvtrace_requests GROUP BY turn ORDER BY turn").result_rows == [
        (0, 1), (1, 1)]
    assert db.query("SELECT count() FROM kvtrace_tokens").result_rows == [(2,)]
