"""Encode SDK spans as one OTLP/JSON ``ExportTraceServiceRequest`` per line.

This is the encoding the OpenTelemetry Collector's file exporter writes and
its OTLP/JSON receivers read: lowercase hex trace/span ids, 64-bit integers as
decimal strings, enums as integers.  Written by hand because the generic
protobuf → JSON path is ~2.5 ms per span and writes ids as base64.

``packed=True`` (the spool, and the ClickHouse exporter that decodes in-process) writes kvtrace's
per-token arrays as packed ``bytesValue`` (``kvtrace/recording/packed_arrays.py``) instead of one
value object per element.

Strings are written as Python holds them; ``utf8_line`` makes the line's bytes, repairing on the
rare line that needs it the strings UTF-8 cannot carry (a client's lone surrogate), so one bad value
never costs the batch it travels in.
"""

from __future__ import annotations

import base64
import json
import math
import re
from array import array
from typing import Any, Iterable, Sequence

from opentelemetry.sdk.trace import ReadableSpan

from kvtrace.recording.packed_arrays import PACKED_ARRAYS, pack

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE = re.compile("[\ud800-\udfff]")

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_string = json.encoder.encode_basestring
"""A str as JSON text, what ``_dumps`` gives for one (in C, without the encoder's Python layer: a
vLLM request span with its cache events carries over a hundred strings)."""


def _double(value: float) -> str:
    if math.isfinite(value):
        return repr(float(value))
    # Proto3 JSON spells non-finite doubles as strings.
    return '"NaN"' if math.isnan(value) else ('"Infinity"' if value > 0 else '"-Infinity"')


def encode_value(value: Any) -> str:
    """One ``AnyValue`` as JSON text."""
    if isinstance(value, bool):
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if isinstance(value, int):
        return '{"intValue":"%d"}' % value
    if isinstance(value, float):
        return '{"doubleValue":%s}' % _double(value)
    if isinstance(value, str):
        return '{"stringValue":%s}' % _string(value)
    if isinstance(value, (list, tuple, array)):
        return '{"arrayValue":{"values":[%s]}}' % _encode_array_items(value)
    if isinstance(value, bytes):
        return '{"bytesValue":"%s"}' % base64.b64encode(value).decode()
    return '{"stringValue":%s}' % _dumps(str(value))


def _encode_array_items(values: Sequence[Any]) -> str:
    if not values:
        return ""
    first = values[0]
    # Homogeneous arrays are the common case (per-token arrays): format them in one pass.
    # (map(str)/map(repr) + join run in C: ~5x faster than formatting element by element.)
    if getattr(values, "typecode", "") == "q" or (type(first) is int and all(type(v) is int for v in values)):
        return '{"intValue":"' + '"},{"intValue":"'.join(map(str, values)) + '"}'
    if type(first) is str and all(type(v) is str for v in values):  # block hashes
        return '{"stringValue":' + '},{"stringValue":'.join(map(_string, values)) + "}"
    if type(first) is float and all(type(v) is float for v in values):
        if all(map(math.isfinite, values)):
            return '{"doubleValue":' + '},{"doubleValue":'.join(map(repr, values)) + "}"
        return ",".join(['{"doubleValue":%s}' % _double(v) for v in values])
    return ",".join([encode_value(v) for v in values])


_ENCODED: tuple[dict, dict] = ({}, {})
"""String and integer attributes already written, ``(key, value)`` → their ``KeyValue`` text (one dict per
type: ``1`` and ``"1"`` differ, ``True`` is no int here).  Most of a request span's attributes repeat on every
span of a process (engine settings, model, capture mode); each dict is cleared whole when full, and a
string longer than :data:`_ENCODED_LONGEST` (a client's text) is never kept."""
_ENCODED_LIMIT = 4096
_ENCODED_LONGEST = 512


def _attribute(key: str, value: Any) -> str:
    """One ``KeyValue`` as JSON text.  Strings and integers, most of a span's attributes, are written
    here without a call into ``encode_value``, and remembered: an exported span has dozens of attributes."""
    kind = type(value)
    remembered = kind is int or (kind is str and len(value) <= _ENCODED_LONGEST)
    if remembered:
        encoded = _ENCODED[kind is int]
        text = encoded.get((key, value))
        if text is not None:
            return text
    if kind is str:
        text = '{"key":%s,"value":{"stringValue":%s}}' % (_string(key), _string(value))
    elif kind is int:
        text = '{"key":%s,"value":{"intValue":"%d"}}' % (_string(key), value)
    else:
        return '{"key":%s,"value":%s}' % (_string(key), encode_value(value))
    if remembered:
        if len(encoded) >= _ENCODED_LIMIT:
            encoded.clear()
        encoded[key, value] = text
    return text


def encode_attributes(attributes: Any) -> str:
    if not attributes:
        return "[]"
    return "[%s]" % ",".join([_attribute(k, v) for k, v in attributes.items()])


def _encode_packed_attributes(attributes: Any) -> str:
    """Like ``encode_attributes``, with the arrays of ``PACKED_ARRAYS`` packed (when they fit their type)."""
    if not attributes:
        return "[]"
    parts = []
    for key, value in attributes.items():
        typecode = PACKED_ARRAYS.get(key)
        packed = pack(value, typecode) if typecode is not None and isinstance(value, (list, tuple, array)) else None
        if packed is None:
            parts.append(_attribute(key, value))
        else:
            parts.append('{"key":"%s","value":{"bytesValue":"%s"}}' % (key, base64.b64encode(packed).decode()))
    return "[%s]" % ",".join(parts)


def _encode_span(span: ReadableSpan, packed: bool) -> str:
    ctx = span.context
    parts = [
        '"traceId":"%032x"' % ctx.trace_id,
        '"spanId":"%016x"' % ctx.span_id,
    ]
    if span.parent is not None and span.parent.span_id:
        parts.append('"parentSpanId":"%016x"' % span.parent.span_id)
    if ctx.trace_state:
        parts.append('"traceState":%s' % _dumps(ctx.trace_state.to_header()))
    parts.append('"name":%s' % _dumps(span.name))
    parts.append('"kind":%d' % (span.kind.value + 1))  # SDK INTERNAL=0 → OTLP SPAN_KIND_INTERNAL=1
    parts.append('"startTimeUnixNano":"%d"' % span.start_time)
    parts.append('"endTimeUnixNano":"%d"' % (span.end_time or span.start_time))
    parts.append('"attributes":%s' % (_encode_packed_attributes if packed else encode_attributes)(span.attributes))
    if span.events:
        parts.append(
            '"events":[%s]'
            % ",".join(
                [
                    '{"timeUnixNano":"%d","name":%s,"attributes":%s}'
                    % (e.timestamp, _dumps(e.name), encode_attributes(e.attributes))
                    for e in span.events
                ]
            )
        )
    if span.links:
        parts.append(
            '"links":[%s]'
            % ",".join(
                [
                    '{"traceId":"%032x","spanId":"%016x","attributes":%s}'
                    % (link.context.trace_id, link.context.span_id, encode_attributes(link.attributes))
                    for link in span.links
                ]
            )
        )
    status = span.status
    if status is not None and status.status_code.value:
        msg = ',"message":%s' % _dumps(status.description) if status.description else ""
        parts.append('"status":{"code":%d%s}' % (status.status_code.value, msg))
    else:
        parts.append('"status":{}')
    return "{%s}" % ",".join(parts)


def encode_request(spans: Iterable[ReadableSpan], packed: bool = False) -> str:
    """All spans as one ``ExportTraceServiceRequest`` JSON line (no newline), grouped by resource and scope.

    ``packed``: kvtrace's per-token arrays as packed ``bytesValue`` (the spool's form); otherwise every
    array is a standard ``arrayValue``, as any OTLP consumer reads it.
    """
    resources: dict[int, tuple[Any, dict[int, tuple[Any, list[str]]]]] = {}
    for span in spans:
        _, scopes = resources.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        scopes.setdefault(id(scope), (scope, []))[1].append(_encode_span(span, packed))
    return '{"resourceSpans":[%s]}' % ",".join(
        '{"resource":{"attributes":%s},"scopeSpans":[%s]}' % (
            encode_attributes(resource.attributes),
            ",".join(
                '{"scope":{"name":%s,"version":%s},"spans":[%s]}' % (
                    _dumps(scope.name if scope else ""),
                    _dumps((scope.version or "") if scope else ""),
                    ",".join(encoded),
                )
                for scope, encoded in scopes.values()
            ),
        )
        for resource, scopes in resources.values()
    )


def utf8_line(line: str) -> tuple[bytes, int]:
    """``line`` and its newline as UTF-8, and how many of its strings had to be repaired for that.

    A string with surrogates (UTF-8 has none: a client's lone ``"\\ud800"``) gets each lone one
    replaced by U+FFFD and each pair joined into the character it stands for; every other string,
    and the line's shape, is left as it was.  The common line costs one ``encode``: the repair runs
    only when that fails.
    """
    try:
        return (line + "\n").encode(), 0
    except UnicodeEncodeError:
        pass
    repaired = 0

    def repair(match: re.Match) -> str:
        nonlocal repaired
        text = match.group()
        if _SURROGATE.search(text) is None:
            return text
        repaired += 1
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")

    # "replace" only where the pattern missed a string: better a "?" than the batch.
    return (_JSON_STRING.sub(repair, line) + "\n").encode("utf-8", "replace"), repaired
