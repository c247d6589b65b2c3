"""Encode SDK spans as one OTLP/JSON ``ExportTraceServiceRequest`` per line.

This is the encoding the OpenTelemetry Collector's file exporter writes and
its OTLP/JSON receivers read: lowercase hex trace/span ids, 64-bit integers as
decimal strings, enums as integers.  Written by hand because the generic
protobuf → JSON path is ~2.5 ms per span and writes ids as base64.

``packed=True`` (the spool, and the ClickHouse exporter that decodes in-process) writes kvtrace's
per-token arrays as packed ``bytesValue`` (``kvtrace/recording/packed_arrays.py``) instead of one
value object per element.

The line is built as plain Python objects and written by msgspec in one call; what repeats (a string,
integer or float attribute seen before, a homogeneous array) goes in as text already written
(``msgspec.Raw``).
Floats are written as Python's ``repr`` writes them, so the bytes are those ``json`` wrote before.

Strings are written as Python holds them; ``utf8_line`` makes the line's bytes, repairing on the
rare line that needs it the strings UTF-8 cannot carry (a client's lone surrogate), so one bad value
never costs the batch it travels in.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from typing import Any, Iterable, Sequence

import msgspec
from opentelemetry.sdk.trace import ReadableSpan

from kvtrace.recording.packed_arrays import PACKED_ARRAYS, pack

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE = re.compile("[\ud800-\udfff]")

_string = json.encoder.encode_basestring
"""A str as JSON text, as msgspec writes one (control characters as ``\\u00XX``, the rest as is)."""
_write = msgspec.json.Encoder().encode
Raw = msgspec.Raw


def _text(text: str) -> Raw:
    """JSON text already written, kept as it is (a lone surrogate too: ``utf8_line`` repairs it)."""
    return Raw(text.encode("utf-8", "surrogatepass"))


_NAN, _INFINITY, _MINUS_INFINITY = _text('"NaN"'), _text('"Infinity"'), _text('"-Infinity"')


def _double(value: float) -> Raw:
    if math.isfinite(value):
        return _text(repr(float(value)))
    # Proto3 JSON spells non-finite doubles as strings.
    return _NAN if math.isnan(value) else (_INFINITY if value > 0 else _MINUS_INFINITY)


def any_value(value: Any) -> Any:
    """One ``AnyValue``, as an object msgspec writes."""
    kind = type(value)
    if kind is str:
        return {"stringValue": value}
    if kind is int:
        return {"intValue": str(value)}
    if kind is list or kind is tuple or kind is array:
        return {"arrayValue": {"values": _array_values(value)}}
    if kind is bool:
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": "%d" % value}
    if isinstance(value, float):
        return {"doubleValue": _double(value)}
    if isinstance(value, str):
        return {"stringValue": str.__str__(value)}
    if isinstance(value, (list, tuple, array)):
        return {"arrayValue": {"values": _array_values(value)}}
    if isinstance(value, bytes):
        return {"bytesValue": bytes(value)}
    return {"stringValue": str(value)}


def _array_values(values: Sequence[Any]) -> Any:
    if len(values) < 3:  # a cache event's block hashes and ids: the elements one by one cost less
        return [any_value(v) for v in values]
    # Homogeneous arrays are the common case (per-token arrays, block hashes and ids): the element types
    # are read in one C pass, and map(str)/map(repr) + join write them in another.
    kinds = _INTS if type(values) is array and values.typecode == "q" else set(map(type, values))
    if kinds == _INTS:
        return _text('[{"intValue":"' + '"},{"intValue":"'.join(map(str, values)) + '"}]')
    if kinds == _STRS:
        return _text('[{"stringValue":' + '},{"stringValue":'.join(map(_string, values)) + "}]")
    if kinds == _FLOATS and all(map(math.isfinite, values)):
        return _text('[{"doubleValue":' + '},{"doubleValue":'.join(map(repr, values)) + "}]")
    return [any_value(v) for v in values]


_INTS, _STRS, _FLOATS = {int}, {str}, {float}

_WRITTEN: dict[type, dict] = {str: {}, int: {}, float: {}}
"""String, integer and float attributes already written, ``(key, value)`` → their ``KeyValue`` text (one dict
per type: ``1``, ``1.0`` and ``"1"`` differ, ``True`` is no int here).  Most of a request span's attributes
repeat on every span of a process (engine settings, model, capture mode, temperature); each dict is cleared
whole when full, a string longer than :data:`_WRITTEN_LONGEST` (a client's text) is never kept, nor a zero
or NaN float (``0.0 == -0.0`` yet they are written differently; a NaN equals nothing)."""
_WRITTEN_LIMIT = 4096
_WRITTEN_LONGEST = 512


def _attribute(key: str, value: Any) -> Any:
    """One ``KeyValue`` not written before."""
    kind = type(value)
    if kind is str:
        text = '{"key":%s,"value":{"stringValue":%s}}' % (_string(key), _string(value))
        kept = len(value) <= _WRITTEN_LONGEST
    elif kind is int:
        text = '{"key":%s,"value":{"intValue":"%d"}}' % (_string(key), value)
        kept = True
    elif kind is float and value and value == value:
        number = repr(value) if math.isfinite(value) else ('"Infinity"' if value > 0 else '"-Infinity"')
        text = '{"key":%s,"value":{"doubleValue":%s}}' % (_string(key), number)
        kept = True
    else:
        return {"key": key, "value": any_value(value)}
    text = _text(text)
    if kept:
        written = _WRITTEN[kind]
        if len(written) >= _WRITTEN_LIMIT:
            written.clear()
        written[key, value] = text
    return text


_NOTHING_PACKED: dict[str, str] = {}


def attributes_list(attributes: Any, packed_arrays: dict[str, str] = _NOTHING_PACKED) -> list:
    """Each ``KeyValue``; the arrays ``packed_arrays`` names packed (when they fit their type).  Strings,
    integers and floats, most of a span's attributes, are looked up here among those written before,
    without a call: an exported span has dozens of attributes."""
    if not attributes:
        return []
    strings, integers, floats = _WRITTEN[str], _WRITTEN[int], _WRITTEN[float]
    parts = []
    append = parts.append
    for key, value in attributes.items():
        kind = type(value)
        if kind is str:
            text = strings.get((key, value))
        elif kind is int:
            text = integers.get((key, value))
        elif kind is float:
            text = floats.get((key, value))
        else:
            typecode = packed_arrays.get(key)
            if typecode is not None and isinstance(value, (list, tuple, array)):
                packed = pack(value, typecode)
                if packed is not None:
                    append({"key": key, "value": {"bytesValue": packed}})
                    continue
            if kind is list or kind is tuple:
                append({"key": key, "value": {"arrayValue": {"values": _array_values(value)}}})
                continue
            text = None
        append(text if text is not None else _attribute(key, value))
    return parts


def _span(span: ReadableSpan, packed: bool) -> dict:
    ctx = span.context
    written = {"traceId": "%032x" % ctx.trace_id, "spanId": "%016x" % ctx.span_id}
    if span.parent is not None and span.parent.span_id:
        written["parentSpanId"] = "%016x" % span.parent.span_id
    if ctx.trace_state:
        written["traceState"] = ctx.trace_state.to_header()
    written["name"] = span.name
    written["kind"] = span.kind.value + 1  # SDK INTERNAL=0 → OTLP SPAN_KIND_INTERNAL=1
    written["startTimeUnixNano"] = "%d" % span.start_time
    written["endTimeUnixNano"] = "%d" % (span.end_time or span.start_time)
    written["attributes"] = attributes_list(span.attributes, PACKED_ARRAYS if packed else _NOTHING_PACKED)
    if span.events:
        written["events"] = [{"timeUnixNano": "%d" % e.timestamp, "name": e.name,
                              "attributes": attributes_list(e.attributes)} for e in span.events]
    if span.links:
        written["links"] = [{"traceId": "%032x" % link.context.trace_id, "spanId": "%016x" % link.context.span_id,
                             "attributes": attributes_list(link.attributes)} for link in span.links]
    status = span.status
    if status is not None and status.status_code.value:
        written["status"] = ({"code": status.status_code.value, "message": status.description}
                             if status.description else {"code": status.status_code.value})
    else:
        written["status"] = {}
    return written


def encode_request(spans: Iterable[ReadableSpan], packed: bool = False) -> str:
    """All spans as one ``ExportTraceServiceRequest`` JSON line (no newline), grouped by resource and scope.

    ``packed``: kvtrace's per-token arrays as packed ``bytesValue`` (the spool's form); otherwise every
    array is a standard ``arrayValue``, as any OTLP consumer reads it.
    """
    resources: dict[int, tuple[Any, dict[int, tuple[Any, list[dict]]]]] = {}
    for span in spans:
        _, scopes = resources.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        scopes.setdefault(id(scope), (scope, []))[1].append(_span(span, packed))
    request = {"resourceSpans": [
        {"resource": {"attributes": attributes_list(resource.attributes)},
         "scopeSpans": [{"scope": {"name": scope.name if scope else "",
                                   "version": (scope.version or "") if scope else ""}, "spans": written}
                        for scope, written in scopes.values()]}
        for resource, scopes in resources.values()
    ]}
    try:
        line = _write(request)
    except UnicodeEncodeError:
        line = _write(_with_surrogates_kept(request))
    return line.decode("utf-8", "surrogatepass")


def _with_surrogates_kept(written: Any) -> Any:
    """``written`` with every string as JSON text already written: msgspec refuses a string UTF-8 cannot
    carry (a client's lone surrogate), which ``utf8_line`` repairs in the line's text."""
    if type(written) is str:
        return _text(_string(written))
    if type(written) is dict:
        return {key: _with_surrogates_kept(value) for key, value in written.items()}
    if type(written) is list:
        return [_with_surrogates_kept(value) for value in written]
    return written


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
