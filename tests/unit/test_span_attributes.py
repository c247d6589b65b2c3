"""A span's attributes become the same ``otel_traces`` text whichever way the ingest takes them:
the quick path for the common shapes (text, integers, arrays of text) and the general conversion."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvtrace.collectors.otlp_rows import (AnyValue, KeyValue, MalformedSpan, rows_from_request, span_attributes,
                                          value_as_string)

SHAPES = {
    "run": {"stringValue": "bench"},
    "quoted": {"stringValue": 'a "quoted" \\ é ✓ text'},
    "empty text": {"stringValue": ""},
    "turn": {"intValue": "7"},
    "json int": {"intValue": -12},
    "big": {"intValue": str(2**63 - 1)},
    "leading zeros": {"intValue": "007"},
    "double": {"doubleValue": 0.1},
    "flag": {"boolValue": True},
    "nothing": {},
    "hashes": {"arrayValue": {"values": [{"stringValue": "1a35b63f"}, {"stringValue": 'x"\\y é'}]}},
    "mixed": {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "1"}, {"boolValue": False}]}},
    "empty list": {"arrayValue": {"values": []}},
    "map": {"kvlistValue": {"values": [{"key": "k", "value": {"stringValue": "v"}}]}},
    "both": {"stringValue": "text wins", "intValue": "1"},
}


def test_every_attribute_shape_reads_as_the_general_conversion_writes_it():
    attributes = msgspec.convert([{"key": key, "value": value} for key, value in SHAPES.items()], list[KeyValue])
    text = span_attributes(attributes)
    assert text == {key: value_as_string(msgspec.convert(value, AnyValue)) for key, value in SHAPES.items()}
    assert text["hashes"] == '["1a35b63f","x\\"\\\\y é"]'
    assert text["big"] == "9223372036854775807" and text["leading zeros"] == "7"


@pytest.mark.parametrize("value, complaint", [
    ({"stringValue": 5}, r"Expected `str \| null`, got `int` - at `\$.*\.attributes\[0\]\.value\.stringValue`"),
    ({"intValue": str(2**63)}, "outside the 64-bit integer range"),
    ({"intValue": "seven"}, "is not an integer"),
    ({"intValue": True}, r"Expected `int \| str \| null`, got `bool`"),
])
def test_a_malformed_attribute_is_refused_with_what_is_wrong_and_where(value, complaint):
    line = {"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "s", "attributes": [
        {"key": "kvtrace.turn", "value": value}]}]}]}]}
    with pytest.raises(MalformedSpan, match=complaint):
        rows_from_request(json.dumps(line))
