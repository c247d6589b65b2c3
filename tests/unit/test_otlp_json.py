"""The spool's OTLP/JSON: every string, in an attribute or an array of them, reads back as it was, and
every scalar keeps its OTLP type."""

from __future__ import annotations

import json
import math
from array import array

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

from kvtrace import semconv as sc
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


def test_a_lone_surrogate_wherever_it_stands_is_repaired_and_the_rest_of_the_line_kept():
    long_text = "lone \udfff " + "x" * 600
    span = ReadableSpan(
        name="name \ud800", context=SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(1)),
        attributes={"long": long_text, "short list": ["\ud800", "ok"], "fine": AWKWARD[1]},
        events=[Event("event \udc00", {"n": 1}, timestamp=5)], start_time=1, end_time=2)

    data, repaired = utf8_line(encode_request([span], packed=True))

    assert repaired == 4
    decoded = json.loads(data)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    attributes = {kv["key"]: kv["value"] for kv in decoded["attributes"]}
    assert decoded["name"] == "name \ufffd" and decoded["events"][0]["name"] == "event \ufffd"
    assert attributes["long"] == {"stringValue": long_text.replace("\udfff", "\ufffd")}
    assert [v["stringValue"] for v in attributes["short list"]["arrayValue"]["values"]] == ["\ufffd", "ok"]
    assert attributes["fine"] == {"stringValue": AWKWARD[1]}


def awkward_spans():
    """Spans that reach every branch of the encoding: each attribute type, arrays of each, empty ones, events,
    links, a parent, trace state, both kinds of status, two resources and two scopes."""
    resource = Resource({"service.name": "kvtrace \"test\"", "service.instance.id": "é-1", "pid": 4242,
                         "ratio": 0.5, "debug": False, "tags": ("a", "b")})
    other_resource = Resource({"service.name": "other"})
    scope = InstrumentationScope("kvtrace", "0.1.0")
    unversioned = InstrumentationScope("plugin\n", None)
    scalars = {"plain": "plain", "quoted": 'a "quoted" \\ word', "control": "\x00\x01\x1f\x7f\b\f\n\r\t end",
               "unicode": "é ü ß 日本語 \u2028 \U0001F600", "empty": "", "long": "0123456789" * 52,
               "int": 7, "zero": 0, "negative": -5, "int64_max": 2**63 - 1, "int64_min": -2**63, "huge": 2**70,
               "true": True, "false": False, "float": 0.25, "negative_zero": -0.0, "tiny": 5e-324,
               "big_float": 1e300, "e16": 1e16, "third": 1 / 3, "nan": math.nan, "inf": math.inf,
               "minus_inf": -math.inf, "bytes": b"\x00\xffbytes", "key \"with\" quotes\n": "k"}
    sequences = {"strings": ["a", 'b "c"', "\x00", "é"], "ints": [1, -2, 2**63 - 1, 2**70],
                 "int_tuple": (3, 4), "int64s": array("q", [5, -6]), "doubles": array("d", [0.5, -0.0, 1e300]),
                 "floats": [0.1, 2.0, 1e-7], "floats_not_finite": [1.0, math.nan, math.inf, -math.inf],
                 "bools": [True, False], "mixed": ["1", 1, True, 1.0, None], "empty_list": [], "empty_tuple": (),
                 "nested": [[1, 2], ("x",)], "bytes_list": [b"ab", b""]}
    packed = {sc.OUTPUT_TOKEN_IDS: array("q", [1, 2**40, -3]), sc.OUTPUT_TOP1_IDS: [1, 2, 3],
              sc.OUTPUT_RUNNER_UP_IDS: [2**70, 1], sc.OUTPUT_MARGINS: array("d", [0.5, math.nan, math.inf]),
              sc.OUTPUT_LOGPROBS: [-0.1, -2.5], sc.PROMPT_TOKEN_IDS: (), sc.OUTPUT_STEP_ROWS: array("q"),
              sc.OUTPUT_STEP_TOKENS: ["not", "ints"], sc.PROMPT_PREFILL_STEPS: 41}
    parent = SpanContext(0x1234, 0xABCD, is_remote=True, trace_flags=TraceFlags(1))
    state = TraceState([("vendor", "value"), ("k", "v1")])
    return [
        ReadableSpan(name="kvtrace.request", context=SpanContext(2**128 - 1, 2**64 - 1, is_remote=False,
                                                                trace_flags=TraceFlags(1), trace_state=state),
                     parent=parent, resource=resource, instrumentation_scope=scope,
                     attributes={**scalars, **sequences, **packed},
                     events=[Event("kvtrace.cache.lookup", {"kvtrace.cache.block_hashes": ["ba24", "\"q\""],
                                                            "kvtrace.cache.block_ids": [1, 2], "empty": []},
                                   timestamp=5),
                             Event("no attributes", timestamp=6)],
                     links=[Link(SpanContext(7, 8, is_remote=True), {"link.kind": "follows", "n": 1}),
                            Link(SpanContext(9, 10, is_remote=True))],
                     kind=SpanKind.CLIENT, status=Status(StatusCode.ERROR, 'failed: "x"\n'),
                     start_time=1_700_000_000_000_000_000, end_time=1_700_000_000_000_000_123),
        ReadableSpan(name="no attributes, no end", context=SpanContext(1, 2, is_remote=False),
                     resource=resource, instrumentation_scope=scope, start_time=10, end_time=None,
                     status=Status(StatusCode.OK)),
        ReadableSpan(name="unversioned scope", context=SpanContext(3, 4, is_remote=False), kind=SpanKind.SERVER,
                     parent=SpanContext(3, 0, is_remote=False), resource=resource,
                     instrumentation_scope=unversioned, attributes={"int": 7, "plain": "plain"},
                     status=Status(StatusCode.ERROR), start_time=11, end_time=12),
        ReadableSpan(name="other resource, no scope", context=SpanContext(5, 6, is_remote=False),
                     resource=other_resource, instrumentation_scope=None,
                     attributes={"float": 0.25, "long": scalars["long"]},
                     start_time=13, end_time=14),
    ]


def test_every_kind_of_value_is_written_byte_for_byte_as_the_spool_and_ingest_have_always_read_it():
    # Ingest, the Collector and spools already written read these bytes: a faster encoding must not move
    # one of them.  Encoded twice, since repeated attributes are remembered after the first span.
    spans = awkward_spans()
    for _ in range(2):
        assert encode_request(spans) == "".join(STANDARD_ARRAYS)
        assert encode_request(spans, packed=True) == "".join(PACKED_ARRAYS_LINE)


# What the encoding wrote for ``awkward_spans()`` before it was last rewritten.
STANDARD_ARRAYS = (
    '{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"kvtra'
    'ce \\"test\\""}},{"key":"service.instance.id","value":{"stringValue":"é-1"}},{"key":"pid","value":'
    '{"intValue":"4242"}},{"key":"ratio","value":{"doubleValue":0.5}},{"key":"debug","value":{"boolVa'
    'lue":false}},{"key":"tags","value":{"arrayValue":{"values":[{"stringValue":"a"},{"stringValue":"'
    'b"}]}}}]},"scopeSpans":[{"scope":{"name":"kvtrace","version":"0.1.0"},"spans":[{"traceId":"fffff'
    'fffffffffffffffffffffffffff","spanId":"ffffffffffffffff","parentSpanId":"000000000000abcd","trac'
    'eState":"vendor=value,k=v1","name":"kvtrace.request","kind":3,"startTimeUnixNano":"1700000000000'
    '000000","endTimeUnixNano":"1700000000000000123","attributes":[{"key":"plain","value":{"stringVal'
    'ue":"plain"}},{"key":"quoted","value":{"stringValue":"a \\"quoted\\" \\\\ word"}},{"key":"control","'
    'value":{"stringValue":"\\u0000\\u0001\\u001f\x7f\\b\\f\\n\\r\\t end"}},{"key":"unicode","value":{"stringVal'
    'ue":"é ü ß 日本語 \u2028 😀"}},{"key":"empty","value":{"stringValue":""}},{"key":"long","value":{"stringV'
    'alue":"01234567890123456789012345678901234567890123456789012345678901234567890123456789012345678'
    '901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234'
    '567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890'
    '123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456'
    '789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012'
    '34567890123456789012345678901234567890123456789"}},{"key":"int","value":{"intValue":"7"}},{"key"'
    ':"zero","value":{"intValue":"0"}},{"key":"negative","value":{"intValue":"-5"}},{"key":"int64_max'
    '","value":{"intValue":"9223372036854775807"}},{"key":"int64_min","value":{"intValue":"-922337203'
    '6854775808"}},{"key":"huge","value":{"intValue":"1180591620717411303424"}},{"key":"true","value"'
    ':{"boolValue":true}},{"key":"false","value":{"boolValue":false}},{"key":"float","value":{"double'
    'Value":0.25}},{"key":"negative_zero","value":{"doubleValue":-0.0}},{"key":"tiny","value":{"doubl'
    'eValue":5e-324}},{"key":"big_float","value":{"doubleValue":1e+300}},{"key":"e16","value":{"doubl'
    'eValue":1e+16}},{"key":"third","value":{"doubleValue":0.3333333333333333}},{"key":"nan","value":'
    '{"doubleValue":"NaN"}},{"key":"inf","value":{"doubleValue":"Infinity"}},{"key":"minus_inf","valu'
    'e":{"doubleValue":"-Infinity"}},{"key":"bytes","value":{"bytesValue":"AP9ieXRlcw=="}},{"key":"ke'
    'y \\"with\\" quotes\\n","value":{"stringValue":"k"}},{"key":"strings","value":{"arrayValue":{"value'
    's":[{"stringValue":"a"},{"stringValue":"b \\"c\\""},{"stringValue":"\\u0000"},{"stringValue":"é"}]}'
    '}},{"key":"ints","value":{"arrayValue":{"values":[{"intValue":"1"},{"intValue":"-2"},{"intValue"'
    ':"9223372036854775807"},{"intValue":"1180591620717411303424"}]}}},{"key":"int_tuple","value":{"a'
    'rrayValue":{"values":[{"intValue":"3"},{"intValue":"4"}]}}},{"key":"int64s","value":{"arrayValue'
    '":{"values":[{"intValue":"5"},{"intValue":"-6"}]}}},{"key":"doubles","value":{"arrayValue":{"val'
    'ues":[{"doubleValue":0.5},{"doubleValue":-0.0},{"doubleValue":1e+300}]}}},{"key":"floats","value'
    '":{"arrayValue":{"values":[{"doubleValue":0.1},{"doubleValue":2.0},{"doubleValue":1e-07}]}}},{"k'
    'ey":"floats_not_finite","value":{"arrayValue":{"values":[{"doubleValue":1.0},{"doubleValue":"NaN'
    '"},{"doubleValue":"Infinity"},{"doubleValue":"-Infinity"}]}}},{"key":"bools","value":{"arrayValu'
    'e":{"values":[{"boolValue":true},{"boolValue":false}]}}},{"key":"mixed","value":{"arrayValue":{"'
    'values":[{"stringValue":"1"},{"intValue":"1"},{"boolValue":true},{"doubleValue":1.0},{"stringVal'
    'ue":"None"}]}}},{"key":"empty_list","value":{"arrayValue":{"values":[]}}},{"key":"empty_tuple","'
    'value":{"arrayValue":{"values":[]}}},{"key":"nested","value":{"arrayValue":{"values":[{"arrayVal'
    'ue":{"values":[{"intValue":"1"},{"intValue":"2"}]}},{"arrayValue":{"values":[{"stringValue":"x"}'
    ']}}]}}},{"key":"bytes_list","value":{"arrayValue":{"values":[{"bytesValue":"YWI="},{"bytesValue"'
    ':""}]}}},{"key":"kvtrace.output.token_ids","value":{"arrayValue":{"values":[{"intValue":"1"},{"i'
    'ntValue":"1099511627776"},{"intValue":"-3"}]}}},{"key":"kvtrace.output.top1_ids","value":{"array'
    'Value":{"values":[{"intValue":"1"},{"intValue":"2"},{"intValue":"3"}]}}},{"key":"kvtrace.output.'
    'runner_up_ids","value":{"arrayValue":{"values":[{"intValue":"1180591620717411303424"},{"intValue'
    '":"1"}]}}},{"key":"kvtrace.output.margins","value":{"arrayValue":{"values":[{"doubleValue":0.5},'
    '{"doubleValue":"NaN"},{"doubleValue":"Infinity"}]}}},{"key":"kvtrace.output.logprobs","value":{"'
    'arrayValue":{"values":[{"doubleValue":-0.1},{"doubleValue":-2.5}]}}},{"key":"kvtrace.prompt.toke'
    'n_ids","value":{"arrayValue":{"values":[]}}},{"key":"kvtrace.output.step_rows","value":{"arrayVa'
    'lue":{"values":[]}}},{"key":"kvtrace.output.step_tokens","value":{"arrayValue":{"values":[{"stri'
    'ngValue":"not"},{"stringValue":"ints"}]}}},{"key":"kvtrace.prompt.prefill_steps","value":{"intVa'
    'lue":"41"}}],"events":[{"timeUnixNano":"5","name":"kvtrace.cache.lookup","attributes":[{"key":"k'
    'vtrace.cache.block_hashes","value":{"arrayValue":{"values":[{"stringValue":"ba24"},{"stringValue'
    '":"\\"q\\""}]}}},{"key":"kvtrace.cache.block_ids","value":{"arrayValue":{"values":[{"intValue":"1"'
    '},{"intValue":"2"}]}}},{"key":"empty","value":{"arrayValue":{"values":[]}}}]},{"timeUnixNano":"6'
    '","name":"no attributes","attributes":[]}],"links":[{"traceId":"00000000000000000000000000000007'
    '","spanId":"0000000000000008","attributes":[{"key":"link.kind","value":{"stringValue":"follows"}'
    '},{"key":"n","value":{"intValue":"1"}}]},{"traceId":"00000000000000000000000000000009","spanId":'
    '"000000000000000a","attributes":[]}],"status":{"code":2,"message":"failed: \\"x\\"\\n"}},{"traceId"'
    ':"00000000000000000000000000000001","spanId":"0000000000000002","name":"no attributes, no end","'
    'kind":1,"startTimeUnixNano":"10","endTimeUnixNano":"10","attributes":[],"status":{"code":1}}]},{'
    '"scope":{"name":"plugin\\n","version":""},"spans":[{"traceId":"00000000000000000000000000000003",'
    '"spanId":"0000000000000004","name":"unversioned scope","kind":2,"startTimeUnixNano":"11","endTim'
    'eUnixNano":"12","attributes":[{"key":"int","value":{"intValue":"7"}},{"key":"plain","value":{"st'
    'ringValue":"plain"}}],"status":{"code":2}}]}]},{"resource":{"attributes":[{"key":"service.name",'
    '"value":{"stringValue":"other"}}]},"scopeSpans":[{"scope":{"name":"","version":""},"spans":[{"tr'
    'aceId":"00000000000000000000000000000005","spanId":"0000000000000006","name":"other resource, no'
    ' scope","kind":1,"startTimeUnixNano":"13","endTimeUnixNano":"14","attributes":[{"key":"float","v'
    'alue":{"doubleValue":0.25}},{"key":"long","value":{"stringValue":"012345678901234567890123456789'
    '012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345'
    '678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901'
    '234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567'
    '890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123'
    '456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789'
    '0123456789"}}],"status":{}}]}]}]}'
)

PACKED_ARRAYS_LINE = (
    '{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"kvtra'
    'ce \\"test\\""}},{"key":"service.instance.id","value":{"stringValue":"é-1"}},{"key":"pid","value":'
    '{"intValue":"4242"}},{"key":"ratio","value":{"doubleValue":0.5}},{"key":"debug","value":{"boolVa'
    'lue":false}},{"key":"tags","value":{"arrayValue":{"values":[{"stringValue":"a"},{"stringValue":"'
    'b"}]}}}]},"scopeSpans":[{"scope":{"name":"kvtrace","version":"0.1.0"},"spans":[{"traceId":"fffff'
    'fffffffffffffffffffffffffff","spanId":"ffffffffffffffff","parentSpanId":"000000000000abcd","trac'
    'eState":"vendor=value,k=v1","name":"kvtrace.request","kind":3,"startTimeUnixNano":"1700000000000'
    '000000","endTimeUnixNano":"1700000000000000123","attributes":[{"key":"plain","value":{"stringVal'
    'ue":"plain"}},{"key":"quoted","value":{"stringValue":"a \\"quoted\\" \\\\ word"}},{"key":"control","'
    'value":{"stringValue":"\\u0000\\u0001\\u001f\x7f\\b\\f\\n\\r\\t end"}},{"key":"unicode","value":{"stringVal'
    'ue":"é ü ß 日本語 \u2028 😀"}},{"key":"empty","value":{"stringValue":""}},{"key":"long","value":{"stringV'
    'alue":"01234567890123456789012345678901234567890123456789012345678901234567890123456789012345678'
    '901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234'
    '567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890'
    '123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456'
    '789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012'
    '34567890123456789012345678901234567890123456789"}},{"key":"int","value":{"intValue":"7"}},{"key"'
    ':"zero","value":{"intValue":"0"}},{"key":"negative","value":{"intValue":"-5"}},{"key":"int64_max'
    '","value":{"intValue":"9223372036854775807"}},{"key":"int64_min","value":{"intValue":"-922337203'
    '6854775808"}},{"key":"huge","value":{"intValue":"1180591620717411303424"}},{"key":"true","value"'
    ':{"boolValue":true}},{"key":"false","value":{"boolValue":false}},{"key":"float","value":{"double'
    'Value":0.25}},{"key":"negative_zero","value":{"doubleValue":-0.0}},{"key":"tiny","value":{"doubl'
    'eValue":5e-324}},{"key":"big_float","value":{"doubleValue":1e+300}},{"key":"e16","value":{"doubl'
    'eValue":1e+16}},{"key":"third","value":{"doubleValue":0.3333333333333333}},{"key":"nan","value":'
    '{"doubleValue":"NaN"}},{"key":"inf","value":{"doubleValue":"Infinity"}},{"key":"minus_inf","valu'
    'e":{"doubleValue":"-Infinity"}},{"key":"bytes","value":{"bytesValue":"AP9ieXRlcw=="}},{"key":"ke'
    'y \\"with\\" quotes\\n","value":{"stringValue":"k"}},{"key":"strings","value":{"arrayValue":{"value'
    's":[{"stringValue":"a"},{"stringValue":"b \\"c\\""},{"stringValue":"\\u0000"},{"stringValue":"é"}]}'
    '}},{"key":"ints","value":{"arrayValue":{"values":[{"intValue":"1"},{"intValue":"-2"},{"intValue"'
    ':"9223372036854775807"},{"intValue":"1180591620717411303424"}]}}},{"key":"int_tuple","value":{"a'
    'rrayValue":{"values":[{"intValue":"3"},{"intValue":"4"}]}}},{"key":"int64s","value":{"arrayValue'
    '":{"values":[{"intValue":"5"},{"intValue":"-6"}]}}},{"key":"doubles","value":{"arrayValue":{"val'
    'ues":[{"doubleValue":0.5},{"doubleValue":-0.0},{"doubleValue":1e+300}]}}},{"key":"floats","value'
    '":{"arrayValue":{"values":[{"doubleValue":0.1},{"doubleValue":2.0},{"doubleValue":1e-07}]}}},{"k'
    'ey":"floats_not_finite","value":{"arrayValue":{"values":[{"doubleValue":1.0},{"doubleValue":"NaN'
    '"},{"doubleValue":"Infinity"},{"doubleValue":"-Infinity"}]}}},{"key":"bools","value":{"arrayValu'
    'e":{"values":[{"boolValue":true},{"boolValue":false}]}}},{"key":"mixed","value":{"arrayValue":{"'
    'values":[{"stringValue":"1"},{"intValue":"1"},{"boolValue":true},{"doubleValue":1.0},{"stringVal'
    'ue":"None"}]}}},{"key":"empty_list","value":{"arrayValue":{"values":[]}}},{"key":"empty_tuple","'
    'value":{"arrayValue":{"values":[]}}},{"key":"nested","value":{"arrayValue":{"values":[{"arrayVal'
    'ue":{"values":[{"intValue":"1"},{"intValue":"2"}]}},{"arrayValue":{"values":[{"stringValue":"x"}'
    ']}}]}}},{"key":"bytes_list","value":{"arrayValue":{"values":[{"bytesValue":"YWI="},{"bytesValue"'
    ':""}]}}},{"key":"kvtrace.output.token_ids","value":{"bytesValue":"AQAAAAAAAAAAAAAAAAEAAP3///////'
    '//"}},{"key":"kvtrace.output.top1_ids","value":{"bytesValue":"AQAAAAAAAAACAAAAAAAAAAMAAAAAAAAA"}'
    '},{"key":"kvtrace.output.runner_up_ids","value":{"arrayValue":{"values":[{"intValue":"1180591620'
    '717411303424"},{"intValue":"1"}]}}},{"key":"kvtrace.output.margins","value":{"bytesValue":"AAAAA'
    'AAA4D8AAAAAAAD4fwAAAAAAAPB/"}},{"key":"kvtrace.output.logprobs","value":{"bytesValue":"mpmZmZmZu'
    'b8AAAAAAAAEwA=="}},{"key":"kvtrace.prompt.token_ids","value":{"bytesValue":""}},{"key":"kvtrace.'
    'output.step_rows","value":{"bytesValue":""}},{"key":"kvtrace.output.step_tokens","value":{"array'
    'Value":{"values":[{"stringValue":"not"},{"stringValue":"ints"}]}}},{"key":"kvtrace.prompt.prefil'
    'l_steps","value":{"intValue":"41"}}],"events":[{"timeUnixNano":"5","name":"kvtrace.cache.lookup"'
    ',"attributes":[{"key":"kvtrace.cache.block_hashes","value":{"arrayValue":{"values":[{"stringValu'
    'e":"ba24"},{"stringValue":"\\"q\\""}]}}},{"key":"kvtrace.cache.block_ids","value":{"arrayValue":{"'
    'values":[{"intValue":"1"},{"intValue":"2"}]}}},{"key":"empty","value":{"arrayValue":{"values":[]'
    '}}}]},{"timeUnixNano":"6","name":"no attributes","attributes":[]}],"links":[{"traceId":"00000000'
    '000000000000000000000007","spanId":"0000000000000008","attributes":[{"key":"link.kind","value":{'
    '"stringValue":"follows"}},{"key":"n","value":{"intValue":"1"}}]},{"traceId":"0000000000000000000'
    '0000000000009","spanId":"000000000000000a","attributes":[]}],"status":{"code":2,"message":"faile'
    'd: \\"x\\"\\n"}},{"traceId":"00000000000000000000000000000001","spanId":"0000000000000002","name":"'
    'no attributes, no end","kind":1,"startTimeUnixNano":"10","endTimeUnixNano":"10","attributes":[],'
    '"status":{"code":1}}]},{"scope":{"name":"plugin\\n","version":""},"spans":[{"traceId":"0000000000'
    '0000000000000000000003","spanId":"0000000000000004","name":"unversioned scope","kind":2,"startTi'
    'meUnixNano":"11","endTimeUnixNano":"12","attributes":[{"key":"int","value":{"intValue":"7"}},{"k'
    'ey":"plain","value":{"stringValue":"plain"}}],"status":{"code":2}}]}]},{"resource":{"attributes"'
    ':[{"key":"service.name","value":{"stringValue":"other"}}]},"scopeSpans":[{"scope":{"name":"","ve'
    'rsion":""},"spans":[{"traceId":"00000000000000000000000000000005","spanId":"0000000000000006","n'
    'ame":"other resource, no scope","kind":1,"startTimeUnixNano":"13","endTimeUnixNano":"14","attrib'
    'utes":[{"key":"float","value":{"doubleValue":0.25}},{"key":"long","value":{"stringValue":"012345'
    '678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901'
    '234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567'
    '890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123'
    '456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789'
    '012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345'
    '6789012345678901234567890123456789"}}],"status":{}}]}]}]}'
)
