"""Hostile and unlucky input to ingest: it quarantines, never crashes, and never stops a query.

A spool directory is shared ground: another tool can drop a line of the wrong shape into it, a
disk can fill, a file can be a copy or a concatenation of ones already stored.  Every command
ingests the spool first, so ingest must put such lines aside with ``FILE:LINE`` and a reason,
store the rest exactly once, and let the query run.  Every test checks the books:
spans stored + lines quarantined == lines written.
"""

from __future__ import annotations

import json
import math

import pytest

from span_lines import request, span_of, spoiled, write_lines

from kvtrace.cli import main
from kvtrace.collectors.ingest import ingest_paths

YEAR_50000_NS = int((50000 - 1970) * 365.2425 * 86400 * 1e9)


def _set(path: str, value):
    """A spoiler that sets a field of the request (dotted path; ``span.`` is the one span)."""

    def spoil(req):
        parts = path.split(".")
        target = span_of(req) if parts[0] == "span" else req
        for part in parts[1:-1] if parts[0] == "span" else parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[parts[-1]] = value

    return spoil


def _attribute(value):
    def spoil(req):
        span_of(req)["attributes"].append({"key": "other.tool", "value": value})

    return spoil


SPAN = "$.resourceSpans[0].scopeSpans[0].spans[0]"
HOSTILE = {
    # wrong shapes: a number, text or list where an object or a list belongs (msgspec says where, as a JSON path)
    "number instead of a resourceSpans entry": ({"resourceSpans": [1]}, "Expected `object`, got `int` - at "
                                                "`$.resourceSpans[0]`"),
    "number instead of the resourceSpans list": ({"resourceSpans": 1}, "Expected `array`, got `int` - at `$.resourceSpans`"),
    "text instead of the resourceSpans list": ({"resourceSpans": "spans"}, "got `str` - at `$.resourceSpans`"),
    "number instead of the resource": (_set("resourceSpans.0.resource", 5), "got `int` - at `$.resourceSpans[0].resource`"),
    "number among resource attributes": (_set("resourceSpans.0.resource.attributes", [1]),
                                         "got `int` - at `$.resourceSpans[0].resource.attributes[0]`"),
    "list instead of the scope": (_set("resourceSpans.0.scopeSpans.0.scope", ["kvtrace"]),
                                  "got `array` - at `$.resourceSpans[0].scopeSpans[0].scope`"),
    "number instead of the spans list": (_set("resourceSpans.0.scopeSpans.0.spans", 5),
                                         "got `int` - at `$.resourceSpans[0].scopeSpans[0].spans`"),
    "text instead of a span": (_set("resourceSpans.0.scopeSpans.0.spans", ["span"]), f"got `str` - at `{SPAN}`"),
    "text instead of the status": (_set("span.status", "OK"), f"got `str` - at `{SPAN}.status`"),
    "object instead of the events list": (_set("span.events", {"name": "x"}), f"got `object` - at `{SPAN}.events`"),
    # wrong types
    "number as trace id": (_set("span.traceId", 12345), f"Expected `str`, got `int` - at `{SPAN}.traceId`"),
    "span id that is neither hex nor base64": (_set("span.spanId", "not-an-id!"), "spanId"),
    "object as span name": (_set("span.name", {"a": 1}), f"got `object` - at `{SPAN}.name`"),
    "number as trace state": (_set("span.traceState", 5), f"got `int` - at `{SPAN}.traceState`"),
    "number as attribute key": (_set("span.attributes", [{"key": 5, "value": {"stringValue": "x"}}]),
                                f"got `int` - at `{SPAN}.attributes[0].key`"),
    "number as stringValue": (_attribute({"stringValue": 7}), f"got `int` - at `{SPAN}.attributes[5].value.stringValue`"),
    "list as doubleValue": (_attribute({"doubleValue": [1]}), f"got `array` - at `{SPAN}.attributes[5].value.doubleValue`"),
    "number as arrayValue": (_attribute({"arrayValue": 3}), f"got `int` - at `{SPAN}.attributes[5].value.arrayValue`"),
    "text as kvlist values": (_attribute({"kvlistValue": {"values": "x"}}),
                              f"got `str` - at `{SPAN}.attributes[5].value.kvlistValue.values`"),
    "number as link trace id": (_set("span.links", [{"traceId": 5, "spanId": "00000000000000aa"}]),
                                f"got `int` - at `{SPAN}.links[0].traceId`"),
    # out of range
    "start time in the year 50000": (_set("span.startTimeUnixNano", str(YEAR_50000_NS)), "year 50,000"),
    "start time before 1970": (_set("span.startTimeUnixNano", "-5"), "before 1970"),
    "start time NaN": (_set("span.startTimeUnixNano", math.nan), "NaN"),  # Python writes NaN, no JSON parser reads it
    "start time that is text": (_set("span.startTimeUnixNano", "soon"), "must be an integer"),
    "end time above int64": (_set("span.endTimeUnixNano", str(2**64)), "2262"),
    "event time in the year 50000": (_set("span.events", [{"timeUnixNano": str(YEAR_50000_NS), "name": "e"}]),
                                     "events[].timeUnixNano"),
    # not an export request at all
    "a JSON list": ([1, 2], "Expected `object`, got `array`"),
    "JSON null": (None, "Expected `object`, got `null`"),
    "logs, not traces": ({"resourceLogs": []}, "missing required field `resourceSpans`"),
    "nesting deeper than the parser goes": ("[" * 100_000 + "]" * 100_000, "Expected `object`, got `array`"),
    # valid to Python's parser, but not storable text (ClickHouse rejects it): one line, not its neighbours
    "a lone surrogate in the span name": (_set("span.name", "\ud800"), "a lone surrogate"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_line_is_quarantined_with_its_place_and_reason_and_the_rest_is_stored(case, db, tmp_path):
    spoil, reason = HOSTILE[case]
    hostile = spoiled(1, spoil) if callable(spoil) else spoil
    lines = [request(0), hostile, request(2), request(3)]
    path = write_lines(tmp_path / "mixed.jsonl", lines)

    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")

    stored = db.query("SELECT count() FROM otel_traces").result_rows[0][0]
    assert (stored, report.quarantined) == (3, 1)
    assert stored + report.quarantined == len(lines)
    assert report.files[0].messages[0].startswith(f"{path}:2: ") and reason in report.files[0].messages[0]
    quarantine_file = tmp_path / "q" / "mixed.jsonl.quarantine.jsonl"
    (record,) = [json.loads(text) for text in quarantine_file.read_text().splitlines()]
    assert (record["file"], record["line"]) == (str(path), 2) and reason in record["error"]
    # The quarantined line is kept as it was written, for whoever wants to repair it.
    assert record["text"] == path.read_text(errors="surrogateescape").splitlines()[1].encode(
        errors="surrogateescape").decode("utf-8", errors="replace")
    # A second pass stores nothing twice and quarantines nothing twice.
    again = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")
    assert (again.spans, again.quarantined) == (0, 0)
    assert db.query("SELECT count() FROM otel_traces").result_rows[0][0] == 3


OUT_OF_RANGE = {
    "integer above int64": {"intValue": str(2**64)},
    "integer below int64": {"intValue": -(2**63) - 1},
    "integer above int64 in a token array": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": str(2**63)}]}},
    "integer above int64 in a map": {"kvlistValue": {"values": [{"key": "k", "value": {"intValue": str(2**70)}}]}},
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_an_integer_outside_int64_costs_its_attribute_not_the_line_that_holds_other_requests(case, db, tmp_path):
    # One line with three requests, as a spool line holds a batch; the second carries the value in an
    # attribute of its own and in one of its event's.
    line = request(0)
    spans = line["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.extend(span_of(request(i)) for i in (1, 2))
    spans[1]["attributes"].append({"key": "other.tool", "value": OUT_OF_RANGE[case]})
    spans[1]["events"][0]["attributes"].append({"key": "other.tool.event", "value": OUT_OF_RANGE[case]})
    path = write_lines(tmp_path / "batch.jsonl", [line, request(3)])

    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")

    assert (report.spans, report.quarantined, report.repaired) == (4, 0, 2)
    assert report.files[0].messages[0].startswith(f"{path}:1: attribute 'other.tool' holds an integer outside")
    rows = db.query("SELECT turn, SpanId FROM kvtrace_requests ORDER BY turn").result_rows
    assert [turn for turn, _ in rows] == [0, 1, 2, 3]
    attributes, events = db.query("SELECT SpanAttributes, Events.Attributes FROM otel_traces "
                                  "WHERE SpanAttributes['kvtrace.turn'] = '1'").result_rows[0]
    assert "other.tool" not in attributes and attributes["kvtrace.run_id"] == "fault-run"
    assert events == [{}]
    assert not (tmp_path / "q").exists()


def test_several_rejected_lines_in_one_batch_are_each_found(db, tmp_path):
    surrogate = _set("span.name", "\ud800")
    lines = [request(0), spoiled(1, surrogate), request(2), request(3), spoiled(4, surrogate), request(5)]
    path = write_lines(tmp_path / "batch.jsonl", lines)

    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")

    stored = db.query("SELECT count() FROM otel_traces").result_rows[0][0]
    assert (stored, report.quarantined) == (4, 2) and stored + report.quarantined == len(lines)
    assert [m.split(": ")[0] for m in report.files[0].messages] == [f"{path}:2", f"{path}:5"]


def _hostile_spool(spool):
    """A spool holding real request spans of two runs that fork, plus every hostile line."""
    spool.mkdir(parents=True, exist_ok=True)
    good = []
    for run, token in (("run-a", "7"), ("run-b", "9")):
        for turn in range(2):
            req = request(len(good), run_id=run)
            attrs = span_of(req)["attributes"]
            attrs[2] = {"key": "kvtrace.turn", "value": {"intValue": str(turn)}}
            if turn == 1:
                attrs[3]["value"]["arrayValue"]["values"][1] = {"intValue": token}
            good.append(req)
    hostile = [spoiled(100 + i, spoil) if callable(spoil) else spoil for i, (spoil, _) in enumerate(HOSTILE.values())]
    write_lines(spool / "other-tool.jsonl", good[:2] + hostile + good[2:])
    return len(good), len(hostile)


def test_every_command_still_answers_with_hostile_lines_in_the_spool(spool_dir, tmp_path, capsys):
    n_good, n_hostile = _hostile_spool(spool_dir)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: shift\n    metric: margin_shift_mean_abs\n    threshold: 1000\n"
                     "    min_samples: 1\n")

    assert main(["runs", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert {r["run_id"] for r in json.loads(out)} == {"run-a", "run-b"}
    assert "other-tool.jsonl:3:" in err and "kvtrace db status" in err  # capped warnings, then a pointer
    assert "Traceback" not in err

    assert main(["query", "runs", "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    assert main(["diff", "run-a", "run-b", "--format", "json"]) == 0
    forks = json.loads(capsys.readouterr().out)
    assert [(f["episode"], f["turn"], f["position"]) for f in forks] == [("e0", 1, 1)]
    assert main(["alert", "--rules", str(rules), "--state", str(tmp_path / "state.json")]) == 0
    assert "Traceback" not in capsys.readouterr().err

    assert main(["db", "status", "--format", "json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["tables"]["otel_traces"] + len(status["quarantined_lines"]) == n_good + n_hostile
    assert sorted(q["line"] for q in status["quarantined_lines"]) == list(range(3, 3 + n_hostile))
    assert all(q["file"].endswith("other-tool.jsonl") and q["error"] for q in status["quarantined_lines"])
