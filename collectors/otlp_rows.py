"""OTLP/JSON ``ExportTraceServiceRequest`` → rows of ``otel_traces``, checked field by field.

Attribute values become text as in the OpenTelemetry Collector's ClickHouse exporter (numbers as
text, booleans ``true``/``false``, arrays and maps as JSON, bytes as base64), so its views read
either writer's rows alike.  With ``typed=True`` (ingest), a ``kvtrace.request`` span's per-token
arrays (``TOKEN_ARRAYS``) become numpy arrays (``SpanRow.arrays``) instead of text: packed ones
(``kvtrace/recording/packed_arrays.py``) are viewed in place, standard ones of older spools read
number by number; and every span ingest writes typed rows for is marked ``TYPED_ROWS_STORED``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from functools import partial
from typing import Any, Optional

import numpy as np

from kvtrace import semconv as sc
from kvtrace.recording.packed_arrays import INT64, PACKED_ARRAYS, TOKEN_ARRAYS
from kvtrace.timestamps import ImplausibleTime, unix_nanos

COLUMNS = [
    "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind",
    "ServiceName", "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration",
    "StatusCode", "StatusMessage",
    "Events.Timestamp", "Events.Name", "Events.Attributes",
    "Links.TraceId", "Links.SpanId", "Links.TraceState", "Links.Attributes",
]
SPAN_KINDS = ("SPAN_KIND_UNSPECIFIED", "SPAN_KIND_INTERNAL", "SPAN_KIND_SERVER", "SPAN_KIND_CLIENT",
              "SPAN_KIND_PRODUCER", "SPAN_KIND_CONSUMER")
STATUS_CODES = ("STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DTYPES = {INT64: np.dtype("<i8"), "d": np.dtype("<f8")}
_B64 = (partial(binascii.a2b_base64, strict_mode=True) if sys.version_info >= (3, 11)  # one C call that checks
        else partial(base64.b64decode, validate=True))
_KINDS = {dict: "an object", list: "a list", str: "text", bool: "a boolean", int: "a number", float: "a number"}


class MalformedSpan(ValueError):
    """A line that is JSON but not an OTLP trace request kvtrace can store."""


class OutOfRange(MalformedSpan):
    """One attribute value that does not fit (an integer outside int64, a per-token array of other
    elements): with a ``dropped`` list the attribute is left out, the span kept."""


class SpanRow(list):
    """One ``otel_traces`` row (values in ``COLUMNS`` order); read with ``typed=True``, a request span's
    per-token arrays by ``kvtrace_requests`` column (absent arrays absent), else ``None``."""

    __slots__ = ("arrays",)

    def __init__(self, values, arrays: Optional[dict[str, np.ndarray]] = None):
        super().__init__(values)
        self.arrays = arrays


def _expect(value: Any, kind: type, what: str):
    """``value`` when it is of ``kind`` (absent: its empty value), else ``MalformedSpan`` naming ``what``."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise MalformedSpan(f"{what} must be {_KINDS[kind]}, got {_KINDS.get(type(value), type(value).__name__)}")
    return value


def _int64(value: Any) -> int:
    """An ``intValue``: a JSON integer or, as proto3 JSON writes int64, a decimal string."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MalformedSpan(f"intValue must be an integer, got {_KINDS.get(type(value), 'null')}")
    try:
        number = int(value)
    except ValueError:
        raise MalformedSpan(f"intValue {value[:40]!r} is not an integer") from None
    if not INT64_MIN <= number <= INT64_MAX:
        raise OutOfRange(f"intValue {number} is outside the 64-bit integer range")
    return number


def _double(value: Any) -> float:
    """A ``doubleValue``: a JSON number, or a string proto3 JSON allows ("NaN", "Infinity", "1.5")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise MalformedSpan(f"doubleValue must be a number, got {_KINDS.get(type(value), 'null')}")
    try:
        return float(value)
    except ValueError:
        raise MalformedSpan(f"doubleValue {value[:40]!r} is not a number") from None


def _double_text(value: float) -> str:
    return repr(value) if math.isfinite(value) else "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"


def _raw(value: Any) -> Any:
    """An AnyValue as a plain JSON-able Python value (for arrays and maps)."""
    value = _expect(value, dict, "attribute value")
    if not value:
        return None
    if "stringValue" in value or "bytesValue" in value:
        return _expect(value.get("stringValue", value.get("bytesValue")), str,
                       "stringValue" if "stringValue" in value else "bytesValue")
    if "intValue" in value:
        return _int64(value["intValue"])
    if "doubleValue" in value:  # proto3 JSON's text for NaN and the infinities stays text, which JSON can carry
        number = _double(value["doubleValue"])
        return value["doubleValue"] if isinstance(value["doubleValue"], str) else number
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_raw(v) for v in _array_values(value)]
    if "kvlistValue" in value:
        pairs = _expect(_expect(value["kvlistValue"], dict, "kvlistValue").get("values"), list, "kvlistValue.values")
        return {_key(kv): _raw(kv.get("value")) for kv in pairs}
    raise MalformedSpan(f"unknown attribute value type {sorted(value)}")


def _array_values(value: dict) -> list:
    return _expect(_expect(value["arrayValue"], dict, "arrayValue").get("values"), list, "arrayValue.values")


def _key(kv: Any) -> str:
    key = _expect(kv, dict, "attribute").get("key")
    if not isinstance(key, str):
        raise MalformedSpan(f"attribute key must be text, got {_KINDS.get(type(key), 'null')}")
    return key


def value_as_string(value: Any) -> str:
    """An attribute value as the Collector's text."""
    value = _expect(value, dict, "attribute value")
    if not value:
        return ""
    if "stringValue" in value:
        return _expect(value["stringValue"], str, "stringValue")
    if "intValue" in value:
        return str(_int64(value["intValue"]))
    if "doubleValue" in value:
        return _double_text(_double(value["doubleValue"]))
    if "boolValue" in value:
        return "true" if value["boolValue"] else "false"
    if type(array := value.get("arrayValue")) is dict and type(values := array.get("values")) is list:
        texts = [v.get("stringValue") if type(v) is dict else None for v in values]  # e.g. block hashes
        if all([type(t) is str for t in texts]):
            return json.dumps(texts, separators=(",", ":"), ensure_ascii=False)
    raw = _raw(value)
    return raw if isinstance(raw, str) else json.dumps(raw, separators=(",", ":"), ensure_ascii=False)


def numbers(value: Any, typecode: str) -> np.ndarray:
    """A per-token array attribute as int64 / float64: packed bytes viewed in place, a standard array
    read number by number (``OutOfRange`` when its elements are not numbers of the type)."""
    value = _expect(value, dict, "attribute value")
    if "bytesValue" in value:
        return _packed(value["bytesValue"], typecode)
    if "arrayValue" not in value:
        raise OutOfRange(f"a per-token array must be an array, got {sorted(value)}")
    read, field = (_int64, "intValue") if typecode == INT64 else (_double, "doubleValue")
    try:
        return np.array([read(_expect(v, dict, "array element").get(field)) for v in _array_values(value)],
                        _DTYPES[typecode])
    except MalformedSpan as exc:
        raise OutOfRange(f"a per-token array holds a value that is not {_DTYPES[typecode]}: {exc}") from None


def _packed(text: Any, typecode: str) -> np.ndarray:
    text = _expect(text, str, "bytesValue")
    try:
        data = _B64(text)
    except (binascii.Error, ValueError):
        data = b"?"
    if len(data) % 8:
        raise MalformedSpan(f"packed array {text[:40]!r} is not base64 of whole 8-byte numbers")
    return np.frombuffer(data, _DTYPES[typecode])


def span_attributes(attributes: Any, arrays: Optional[dict] = None, dropped: Optional[list[str]] = None) -> dict:
    """A span's attributes as text by key; with ``arrays`` (a request span read typed), its per-token arrays
    go there by column instead.  ``dropped``: see ``rows_from_request``."""
    out: dict[str, str] = {}
    for kv in _expect(attributes, list, "attributes"):
        if type(kv) is dict:  # the common shapes without the general path's calls (per span they add up)
            key, value = kv.get("key"), kv.get("value")
            if type(key) is str and type(value) is dict:
                if type(text := value.get("stringValue")) is str:
                    out[key] = text
                    continue
                if type(text := value.get("intValue")) is str and text.isascii() and text.isdigit() and len(text) < 19:
                    out[key] = str(int(text))  # below 10**18: inside int64
                    continue
                if arrays is not None and "bytesValue" in value and key in TOKEN_ARRAYS:
                    out.pop(key, None)
                    arrays[TOKEN_ARRAYS[key]] = _packed(value["bytesValue"], PACKED_ARRAYS[key])
                    continue
        key = _key(kv)
        typecode = PACKED_ARRAYS.get(key)
        out.pop(key, None)  # a repeated key: the last value counts
        try:
            if typecode is None:
                out[key] = value_as_string(kv.get("value"))
            elif arrays is not None and key in TOKEN_ARRAYS:
                arrays[TOKEN_ARRAYS[key]] = numbers(kv.get("value"), typecode)
            elif "bytesValue" in _expect(kv.get("value"), dict, "attribute value"):  # e.g. packed prompt ids
                out[key] = "[" + ",".join(map(str if typecode == INT64 else _double_text,
                                              numbers(kv.get("value"), typecode).tolist())) + "]"
            else:
                out[key] = value_as_string(kv.get("value"))
        except OutOfRange:
            if dropped is None:
                raise
            dropped.append(key)
            if arrays is not None:
                arrays.pop(TOKEN_ARRAYS.get(key, ""), None)
    return out


def _hex_id(value: Any, nbytes: int, what: str) -> str:
    """OTLP/JSON ids are hex; protobuf's generic JSON mapping writes base64.  Accept both."""
    value = _expect(value, str, what)
    if not value:
        return ""
    if len(value) == nbytes * 2:
        try:
            int(value, 16)
            return value.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedSpan(f"{what} {value[:60]!r} is neither hex nor base64") from None
    if len(raw) != nbytes:
        raise MalformedSpan(f"{what} {value[:60]!r} has {len(raw)} bytes, expected {nbytes}")
    return raw.hex()


def _enum(value: Any, names: tuple[str, ...]) -> str:
    if isinstance(value, str):
        return value if value in names else names[0]
    return names[value] if isinstance(value, int) and 0 <= value < len(names) else names[0]


def _nanos(value: Any, what: str) -> int:
    try:
        return unix_nanos(value, what)
    except ImplausibleTime as exc:
        raise MalformedSpan(str(exc)) from None


def rows_from_request(request: Any, typed: bool = False, dropped: Optional[list[str]] = None) -> list[SpanRow]:
    """One ``otel_traces`` row per span of an export request (``typed``: see the module doc).

    Anything that does not fit the table (a wrong shape or type, an id that is not 8/16 bytes, a time
    outside what ``DateTime64(9)`` holds) raises ``MalformedSpan`` naming the field, so the caller can
    quarantine the request.  With a ``dropped`` list one value is no reason to lose a request that may
    hold many spans: an attribute that does not fit (``OutOfRange``) is left out and its key listed.
    """
    if not isinstance(request, dict) or "resourceSpans" not in request:
        raise MalformedSpan("not an OTLP trace export request (no resourceSpans)")
    rows = []
    try:
        for resource_spans in _expect(request["resourceSpans"], list, "resourceSpans"):
            resource_spans = _expect(resource_spans, dict, "resourceSpans[]")
            resource = _expect(resource_spans.get("resource"), dict, "resource")
            resource_attrs = span_attributes(resource.get("attributes"), dropped=dropped)
            scopes = resource_spans.get("scopeSpans") or resource_spans.get("instrumentationLibrarySpans")
            for scope_spans in _expect(scopes, list, "scopeSpans"):
                scope_spans = _expect(scope_spans, dict, "scopeSpans[]")
                scope = _expect(scope_spans.get("scope") or scope_spans.get("instrumentationLibrary"), dict, "scope")
                head = (resource_attrs.get("service.name", ""), resource_attrs,
                        _expect(scope.get("name"), str, "scope.name"), _expect(scope.get("version"), str, "scope.version"))
                for span in _expect(scope_spans.get("spans"), list, "spans"):
                    rows.append(_span_row(_expect(span, dict, "span"), head, typed, dropped))
    except MalformedSpan:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        # A shape the checks above did not foresee: still this request's fault, never the caller's.
        raise MalformedSpan(f"unexpected shape: {type(exc).__name__}: {exc}") from None
    return rows


def _span_row(span: dict, head: tuple, typed: bool, dropped: Optional[list[str]]) -> SpanRow:
    service, resource_attrs, scope_name, scope_version = head
    start = _nanos(span.get("startTimeUnixNano"), "startTimeUnixNano")
    end = _nanos(span.get("endTimeUnixNano"), "endTimeUnixNano") or start
    events = [_expect(e, dict, "events[]") for e in _expect(span.get("events"), list, "events")]
    links = [_expect(link, dict, "links[]") for link in _expect(span.get("links"), list, "links")]
    status = _expect(span.get("status"), dict, "status")
    name = _expect(span.get("name"), str, "name")
    arrays = {} if typed and name == sc.SPAN_REQUEST else None
    attributes = span_attributes(span.get("attributes"), arrays, dropped)
    event_names = [_expect(e.get("name"), str, "events[].name") for e in events]
    if arrays is not None or (typed and any(n.startswith(sc.CACHE_EVENT_PREFIX) for n in event_names)):
        attributes[sc.TYPED_ROWS_STORED] = "true"
    return SpanRow([
        start, _hex_id(span.get("traceId"), 16, "traceId"), _hex_id(span.get("spanId"), 8, "spanId"),
        _hex_id(span.get("parentSpanId"), 8, "parentSpanId"), _expect(span.get("traceState"), str, "traceState"),
        name, _enum(span.get("kind"), SPAN_KINDS), service, resource_attrs, scope_name, scope_version, attributes,
        max(0, end - start), _enum(status.get("code"), STATUS_CODES), _expect(status.get("message"), str, "status.message"),
        [_nanos(e.get("timeUnixNano"), "events[].timeUnixNano") for e in events], event_names,
        [span_attributes(e.get("attributes"), dropped=dropped) for e in events],
        [_hex_id(link.get("traceId"), 16, "links[].traceId") for link in links],
        [_hex_id(link.get("spanId"), 8, "links[].spanId") for link in links],
        [_expect(link.get("traceState"), str, "links[].traceState") for link in links],
        [span_attributes(link.get("attributes"), dropped=dropped) for link in links],
    ], arrays)
