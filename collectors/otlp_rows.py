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


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "an object", list: "a list", str: "text", bool: "a boolean",
                                         int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _object(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedSpan(f"{what} must be an object, got {_kind(value)}")
    return value


def _list(value: Any, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedSpan(f"{what} must be a list, got {_kind(value)}")
    return value


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedSpan(f"{what} must be text, got {_kind(value)}")
    return value


def _int64(value: Any) -> int:
    """An ``intValue``: a JSON integer or, as proto3 JSON writes int64, a decimal string."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MalformedSpan(f"intValue must be an integer, got {_kind(value)}")
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
        raise MalformedSpan(f"doubleValue must be a number, got {_kind(value)}")
    try:
        return float(value)
    except ValueError:
        raise MalformedSpan(f"doubleValue {value[:40]!r} is not a number") from None


def _double_text(value: float) -> str:
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def _b64(data: Any) -> bytes:
    data = _text(data, "bytesValue")
    try:
        return binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):
        raise MalformedSpan(f"packed array {data[:40]!r} is not base64 of whole 8-byte numbers") from None


def _raw(value: Any) -> Any:
    """An AnyValue as a plain JSON-able Python value (for arrays and maps)."""
    value = _object(value, "attribute value")
    if not value:
        return None
    if "stringValue" in value:
        return _text(value["stringValue"], "stringValue")
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
        pairs = _list(_object(value["kvlistValue"], "kvlistValue").get("values"), "kvlistValue.values")
        return {_key(kv): _raw(kv.get("value")) for kv in pairs}
    if "bytesValue" in value:
        return _text(value["bytesValue"], "bytesValue")
    raise MalformedSpan(f"unknown attribute value type {sorted(value)}")


def _array_values(value: dict) -> list:
    return _list(_object(value["arrayValue"], "arrayValue").get("values"), "arrayValue.values")


def _key(kv: Any) -> str:
    key = _object(kv, "attribute").get("key")
    if not isinstance(key, str):
        raise MalformedSpan(f"attribute key must be text, got {_kind(key)}")
    return key


def value_as_string(value: Any) -> str:
    """An attribute value as the Collector's text; an array kvtrace packs is written as its numbers."""
    value = _object(value, "attribute value")
    if not value:
        return ""
    if "stringValue" in value:
        return _text(value["stringValue"], "stringValue")
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
    value = _object(value, "attribute value")
    if "bytesValue" in value:
        return _packed(value["bytesValue"], typecode)
    if "arrayValue" not in value:
        raise OutOfRange(f"a per-token array must be an array, got {sorted(value)}")
    try:
        if typecode == INT64:
            return np.array([_int64(_object(v, "array element").get("intValue")) for v in _array_values(value)],
                            np.int64)
        return np.array([_double(_object(v, "array element").get("doubleValue")) for v in _array_values(value)],
                        np.float64)
    except MalformedSpan as exc:
        raise OutOfRange(f"a per-token array holds a value that is not {_DTYPES[typecode]}: {exc}") from None


def _packed(text: Any, typecode: str) -> np.ndarray:
    data = _b64(text)
    if len(data) % 8:
        raise MalformedSpan(f"packed array of {len(data)} bytes is not base64 of whole 8-byte numbers")
    return np.frombuffer(data, _DTYPES[typecode])


def _numbers_text(array: np.ndarray) -> str:
    if array.dtype.kind == "i":
        return "[" + ",".join(map(str, array.tolist())) + "]"
    return "[" + ",".join(map(_double_text, array.tolist())) + "]"


def span_attributes(attributes: Any, arrays: Optional[dict] = None, dropped: Optional[list[str]] = None) -> dict:
    """A span's attributes as text by key; with ``arrays`` (a request span read typed), its per-token arrays
    go there by column instead.  ``dropped``: see ``rows_from_request``."""
    out: dict[str, str] = {}
    for kv in _list(attributes, "attributes"):
        if type(kv) is dict:  # the common shapes without the general path's calls (per span they add up)
            key, value = kv.get("key"), kv.get("value")
            if type(key) is str and type(value) is dict:
                if type(text := value.get("stringValue")) is str:
                    out[key] = text
                    continue
                if type(text := value.get("intValue")) is str and text.isascii() and text.isdigit() and len(text) < 19:
                    out[key] = str(int(text))  # below 10**18: inside int64
                    continue
                if arrays is not None and type(text := value.get("bytesValue")) is str and key in TOKEN_ARRAYS:
                    out.pop(key, None)
                    arrays[TOKEN_ARRAYS[key]] = _packed(text, PACKED_ARRAYS[key])
                    continue
        key = _key(kv)
        typecode = PACKED_ARRAYS.get(key)
        try:
            if typecode is None:
                out[key] = value_as_string(kv.get("value"))
            elif arrays is not None and key in TOKEN_ARRAYS:
                out.pop(key, None)  # a repeated key: the last value counts
                arrays[TOKEN_ARRAYS[key]] = numbers(kv.get("value"), typecode)
            elif "bytesValue" in _object(kv.get("value"), "attribute value"):
                out[key] = _numbers_text(numbers(kv.get("value"), typecode))
            else:
                out[key] = value_as_string(kv.get("value"))
        except OutOfRange:
            if dropped is None:
                raise
            dropped.append(key)
            out.pop(key, None)
            if arrays is not None:
                arrays.pop(TOKEN_ARRAYS.get(key, ""), None)
    return out


def _hex_id(value: Any, nbytes: int, what: str) -> str:
    """OTLP/JSON ids are hex; protobuf's generic JSON mapping writes base64.  Accept both."""
    value = _text(value, what)
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
    if isinstance(value, int) and 0 <= value < len(names):
        return names[value]
    return names[0]


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
        for resource_spans in _list(request["resourceSpans"], "resourceSpans"):
            resource_spans = _object(resource_spans, "resourceSpans[]")
            resource = _object(resource_spans.get("resource"), "resource")
            resource_attrs = span_attributes(resource.get("attributes"), dropped=dropped)
            scopes = resource_spans.get("scopeSpans") or resource_spans.get("instrumentationLibrarySpans")
            for scope_spans in _list(scopes, "scopeSpans"):
                scope_spans = _object(scope_spans, "scopeSpans[]")
                scope = _object(scope_spans.get("scope") or scope_spans.get("instrumentationLibrary"), "scope")
                head = (resource_attrs.get("service.name", ""), resource_attrs, _text(scope.get("name"), "scope.name"),
                        _text(scope.get("version"), "scope.version"))
                for span in _list(scope_spans.get("spans"), "spans"):
                    rows.append(_span_row(_object(span, "span"), head, typed, dropped))
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
    events = [_object(e, "events[]") for e in _list(span.get("events"), "events")]
    links = [_object(link, "links[]") for link in _list(span.get("links"), "links")]
    status = _object(span.get("status"), "status")
    name = _text(span.get("name"), "name")
    arrays = {} if typed and name == sc.SPAN_REQUEST else None
    attributes = span_attributes(span.get("attributes"), arrays, dropped)
    event_names = [_text(e.get("name"), "events[].name") for e in events]
    if arrays is not None or (typed and any(n.startswith(sc.CACHE_EVENT_PREFIX) for n in event_names)):
        attributes[sc.TYPED_ROWS_STORED] = "true"
    return SpanRow([
        start,
        _hex_id(span.get("traceId"), 16, "traceId"),
        _hex_id(span.get("spanId"), 8, "spanId"),
        _hex_id(span.get("parentSpanId"), 8, "parentSpanId"),
        _text(span.get("traceState"), "traceState"),
        name,
        _enum(span.get("kind"), SPAN_KINDS),
        service,
        resource_attrs,
        scope_name,
        scope_version,
        attributes,
        max(0, end - start),
        _enum(status.get("code"), STATUS_CODES),
        _text(status.get("message"), "status.message"),
        [_nanos(e.get("timeUnixNano"), "events[].timeUnixNano") for e in events],
        event_names,
        [span_attributes(e.get("attributes"), dropped=dropped) for e in events],
        [_hex_id(link.get("traceId"), 16, "links[].traceId") for link in links],
        [_hex_id(link.get("spanId"), 8, "links[].spanId") for link in links],
        [_text(link.get("traceState"), "links[].traceState") for link in links],
        [span_attributes(link.get("attributes"), dropped=dropped) for link in links],
    ], arrays)
