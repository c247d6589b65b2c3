"""The database writes the per-token arrays' text into otel_traces exactly as the Collector's exporter does.

`kvtrace db ingest` hands a request span over once, its arrays packed, and the database makes their JSON
text (`17_kvtrace_request_spans_otel_traces_mv.sql`).  Go's encoding/json is the model: the shortest text
that reads back to the same double, "-0" for a negative zero, an exponent below 1e-6 and from 1e21 on,
signed when positive ("1e+21").  Spans whose arrays do not stand as kvtrace writes them take the JSON
view's way, and still end with the same rows.
"""

from __future__ import annotations

import json
import math
import random
import struct

from kvtrace import correlate
from kvtrace import semconv as sc
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.otlp_rows import COLUMNS, rows_from_request
from kvtrace.collectors.schema import init_schema
from kvtrace.db import connect

# Where Go's text and ClickHouse's differ (1e21 and up), where either switches notation (1e-6, 1e21),
# the extremes of the type, and zeros of both signs.
BOUNDARIES = [1e21, -1e21, math.nextafter(1e21, 0), 1e22, 1.5e300, 1.7976931348623157e308, 123456789012345680000.0,
              1e20, 1e-6, math.nextafter(1e-6, 0), 1e-7, 0.000015, 4.35e-7, 5e-324, 2.2250738585072014e-308,
              -0.0, 0.0, 2.0**53, 2.0**63, 0.1 + 0.2, 1.0, -1.5]
SPAN_ATTRIBUTES = COLUMNS.index("SpanAttributes")


def random_doubles(rng: random.Random, n: int) -> list[float]:
    """Doubles of every magnitude: random bit patterns (finite ones), and decimals near both switches."""
    out = []
    while len(out) < n:
        choice = rng.randrange(4)
        if choice == 0:
            value = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
        elif choice == 1:
            value = rng.uniform(-30, 30)
        else:
            value = rng.choice([1, -1]) * 10 ** rng.uniform(-8, -5) if choice == 2 else 10 ** rng.uniform(19, 23)
        if value == value and abs(value) != float("inf"):
            out.append(value)
    return out


def spool_lines(spool_dir) -> list[dict]:
    return [json.loads(line) for path in sorted(spool_dir.glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_the_database_writes_every_double_as_the_collector_does(spool_recorder, spool_dir, db, tmp_path):
    rng = random.Random(21)
    requests = [BOUNDARIES] + [random_doubles(rng, 500) for _ in range(8)]
    for turn, margins in enumerate(requests):
        with correlate(run_id="text", episode_id="e", turn=turn):
            rec = spool_recorder.start_request("test_engine")
        for i, margin in enumerate(margins):
            rec.add_token(rng.getrandbits(63) * rng.choice([1, -1]), i, 2**63 - 1, margin, -margin)
        spool_recorder.finish(rec)
    spool_recorder.pipeline.force_flush()

    assert ingest_paths(db, [spool_dir], quarantine_dir=tmp_path / "q").spans == len(requests)

    # The Collector's text for the same spans, as this module writes it for otel_traces (format_double).
    collector = {row[COLUMNS.index("SpanId")]: row[SPAN_ATTRIBUTES]
                 for line in spool_lines(spool_dir) for row in rows_from_request(line)}
    stored = dict(db.query("SELECT SpanId, SpanAttributes FROM otel_traces").result_rows)
    assert stored.keys() == collector.keys()
    for span_id, attributes in stored.items():
        assert list(attributes.items()) == list(collector[span_id].items())  # every value, in the span's order
    boundaries = next(a for a in stored.values() if a[sc.TURN] == "0")[sc.OUTPUT_MARGINS]
    assert boundaries.startswith("[1e+21,-1e+21,999999999999999900000,1e+22,1.5e+300,1.7976931348623157e+308,")
    assert ",100000000000000000000,0.000001,9.999999999999997e-7,1e-7,0.000015,4.35e-7,5e-324," in boundaries
    assert ",-0,0,9007199254740992,9223372036854776000,0.30000000000000004,1,-1.5]" in boundaries

    # And kvtrace_requests holds the numbers themselves: bit for bit, a negative zero read back as 0.
    (margins,), = db.query("SELECT margins FROM kvtrace_requests WHERE turn = 0").result_rows
    assert [struct.pack("<d", m) for m in margins] == [struct.pack("<d", m + 0.0) for m in BOUNDARIES]


def _request_line(attributes: list[dict], i: int) -> dict:
    start = 1_700_000_000_000_000_000 + i
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "s"}}]},
                               "scopeSpans": [{"scope": {"name": "kvtrace"}, "spans": [{
                                   "traceId": "%032x" % (i + 1), "spanId": "%016x" % (i + 1), "name": sc.SPAN_REQUEST,
                                   "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 10),
                                   "attributes": [{"key": sc.RUN_ID, "value": {"stringValue": "placed"}},
                                                  {"key": sc.TURN, "value": {"intValue": str(i)}}, *attributes]}]}]}]}


def _ints(*values: int) -> dict:
    return {"arrayValue": {"values": [{"intValue": str(v)} for v in values]}}


def _doubles(*values: float) -> dict:
    return {"arrayValue": {"values": [{"doubleValue": v} for v in values]}}


def test_arrays_that_stand_apart_or_out_of_order_take_the_json_view_and_end_the_same(tmp_path):
    ids, margins = {"key": sc.OUTPUT_TOKEN_IDS, "value": _ints(7, 8)}, {"key": sc.OUTPUT_MARGINS,
                                                                          "value": _doubles(0.5, 1e21)}
    between = {"key": sc.OUTPUT_FINISH_REASON, "value": {"stringValue": "length"}}
    lines = [_request_line([ids, margins], 0),           # side by side, in order: the database writes the text
             _request_line([margins, ids], 1),           # out of order
             _request_line([ids, between, margins], 2),  # something in between
             _request_line([], 3)]                       # no arrays at all
    assert [rows_from_request(line, packed=True)[0].arrays is not None for line in lines] == [True, False, False, True]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    answers = []
    for name, store in (("ingested", lambda client: ingest_paths(client, [path], quarantine_dir=tmp_path / "q")),
                        ("collector", lambda client: [client.insert("otel_traces", rows_from_request(line),
                                                                    column_names=COLUMNS) for line in lines])):
        client = connect(f"chdb://{tmp_path / name}")
        init_schema(client)
        store(client)
        answers.append([[repr(row) for row in client.query(f"SELECT * FROM {table} ORDER BY {order}").result_rows]
                        for table, order in (("otel_traces", "SpanId"), ("kvtrace_requests", "SpanId"),
                                             ("kvtrace_tokens", "SpanId, position"))])  # repr: NaN is NaN
        client.close()
    ingested, collector = answers
    assert ingested == collector
    assert [len(rows) for rows in ingested] == [4, 4, 6]
