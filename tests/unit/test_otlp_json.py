"""The spool's OTLP/JSON: every string, in an attribute or an array of them, reads back as it was, and
every scalar keeps its OTLP type."""

from __future__ import annotations

import json
from array import array

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from kvtrace.recording.exporters.otlp_json import encode_request, utf8_line

AWKWARD = ['plain', 'a "quoted" word', "back\\slash", "new\nline\ttab", "\x00\x1f control", "é ü ß", "日本語",
           "emoji \U0001F600"]


def test_strings_and_arrays_of_strings_survive_the_encoding():
    span = ReadableSpan(
        name="kvtrace.request", context=SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(1)),
        attributes={"one": AWKWARD[1], "many": AWKWARD, "hashes": ["ba24e594dfc183aa", "0f"],
                    "ints": array("q", [1, -2]), "key \"with\" quotes": "x", "flag": True, "n": -5, "x": 0.25},
        events=[Event("kvtrace.cache.store", {"kvtrace.cache.block_hashes": AWKWARD}, timestamp=5)],
        start_time=1, end_time=2)

    decoded = json.loads(encode_request([span], packed=True))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    attributes = {kv["key"]: kv["value"] for kv in decoded["attributes"]}

    assert attributes["one"] == {"stringValue": AWKWARD[1]}
    assert [v["stringValue"] for v in attributes["many"]["arrayValue"]["values"]] == AWKWARD
    assert [v["stringValue"] for v in attributes["hashes"]["arrayValue"]["values"]] == ["ba24e594dfc183aa", "0f"]
    assert [v["intValue"] for v in attributes["ints"]["arrayValue"]["values"]] == ["1", "-2"]
    assert attributes['key "with" quotes'] == {"stringValue": "x"}
    assert (attributes["flag"], attributes["n"], attributes["x"]) == (
        {"boolValue": True}, {"intValue": "-5"}, {"doubleValue": 0.25})
    (event,) = decoded["events"]
    assert [v["stringValue"] for v in event["attributes"][0]["value"]["arrayValue"]["values"]] == AWKWARD


def test_a_value_written_before_under_the_same_key_keeps_its_own_type():
    # Attributes that repeat on every span are written once and remembered: "1", 1, True and 1.0 under one
    # key compare equal as Python values, yet each keeps its OTLP type, span after span.
    def attributes(value):
        span = ReadableSpan(name="kvtrace.request", context=SpanContext(1, 2, is_remote=False,
                                                                       trace_flags=TraceFlags(1)),
                            attributes={"k": value}, start_time=1, end_time=2)
        decoded = json.loads(encode_request([span], packed=True))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        return decoded["attributes"][0]["value"]

    for _ in range(2):
        assert attributes("1") == {"stringValue": "1"}
        assert attributes(1) == {"intValue": "1"}
        assert attributes(True) == {"boolValue": True}
        assert attributes(1.0) == {"doubleValue": 1.0}


def test_a_line_utf8_can_carry_is_its_plain_encoding_and_one_it_cannot_is_repaired_string_by_string():
    span = ReadableSpan(
        name="kvtrace.request", context=SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(1)),
        attributes={"model": "bad\ud800model", "pair": "\ud83d\ude00 joined", "fine": AWKWARD[1],
                    "many": ["ok", "lone \udfff end", 'quoted \\"\ud800'], "ints": array("q", [1, 2])},
        start_time=1, end_time=2)
    line = encode_request([span], packed=True)

    good = encode_request([ReadableSpan(name="n", context=span.context, attributes={"a": AWKWARD},
                                        start_time=1, end_time=2)])
    assert utf8_line(good) == ((good + "\n").encode(), 0)

    data, repaired = utf8_line(line)
    assert repaired == 4 and data.endswith(b"\n")
    attributes = {kv["key"]: kv["value"] for kv in
                  json.loads(data)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]}
    assert attributes["model"] == {"stringValue": "bad\ufffdmodel"}
    assert attributes["pair"] == {"stringValue": "\U0001F600 joined"}
    assert attributes["fine"] == {"stringValue": AWKWARD[1]}
    assert [v["stringValue"] for v in attributes["many"]["arrayValue"]["values"]] == [
        "ok", "lone \ufffd end", 'quoted \\"\ufffd']
    assert "ints" in attributes
