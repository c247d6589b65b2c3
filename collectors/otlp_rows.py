"""OTLP/JSON ``ExportTraceServiceRequest`` → rows of ``otel_traces``.

Values are stringified the way the OpenTelemetry Collector's ClickHouse
exporter does it (``pcommon.Value.AsString``): numbers as text, booleans as
``true``/``false``, arrays and maps as JSON, bytes as base64.  Doubles use the
shortest round-trip form, so float margins survive bit-exact.

kvtrace's per-token arrays arrive either as standard arrays (a Collector's
file, a spool of an older kvtrace) or packed (``kvtrace/recording/packed_arrays.py``,
the spool of this version); both become the same JSON text in ``otel_traces``.
With ``packed=True`` (ingest into a database that has ``kvtrace_request_spans``),
a ``kvtrace.request`` span whose per-token arrays are plain finite numbers of
their type, standing side by side in ``TOKEN_ARRAYS`` order, keeps them as
numbers (``SpanRow.arrays``) and leaves their values in ``SpanAttributes``
empty: the database writes that text (``17_kvtrace_request_spans_otel_traces_mv.sql``),
and ``collector_row`` writes it here where the database cannot.  Any other span
gets its text here, and ``SpanRow.arrays`` is ``None``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from array import array
from decimal import Decimal
from typing import Any, Optional

from kvtrace import semconv as sc
from kvtrace.recording.packed_arrays import FLOAT64, INT64, PACKED_ARRAYS, TOKEN_ARRAYS, unpack
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
_SPAN_ATTRIBUTES = COLUMNS.index("SpanAttributes")


class MalformedSpan(ValueError):
    """A line that is JSON but not an OTLP trace request kvtrace can store."""


class OutOfRange(MalformedSpan):
    """An attribute's integer outside int64: with a ``dropped`` list the attribute is left out, the span kept."""


class SpanRow(list):
    """One ``otel_traces`` row (values in ``COLUMNS`` order) and, for a request span read with
    ``packed=True`` whose per-token arrays are plain numbers, those arrays by attribute key (the keys of
    ``TOKEN_ARRAYS`` the span has; their values in SpanAttributes are left empty)."""

    __slots__ = ("arrays",)

    def __init__(self, values, arrays: Optional[dict[str, array]] = None):
        super().__init__(values)
        self.arrays = arrays


def collector_row(row: SpanRow) -> SpanRow:
    """``row`` as the Collector's exporter writes it: the text of its per-token arrays in SpanAttributes."""
    if row.arrays is None:
        return row
    attributes = dict(row[_SPAN_ATTRIBUTES])  # same keys, same order: only the empty values change
    for key, numbers in row.arrays.items():
        attributes[key] = _numbers_json(numbers)
    complete = SpanRow(row)
    complete[_SPAN_ATTRIBUTES] = attributes
    return complete


def format_double(value: float) -> str:
    """A double as Go's encoding/json writes it (ES6 number-to-string), exact round trip."""
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    text = repr(float(value))
    if text.endswith(".0"):
        return text[:-2]
    if "e" in text:
        magnitude = abs(value)
        if 1e-6 <= magnitude < 1e21:
            # ES6 writes these without an exponent.
            return format(Decimal(text), "f")
        mantissa, exponent = text.split("e")
        sign = "-" if exponent.startswith("-") else "+"
        return f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"
    return text


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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


def _double(value: Any) -> Any:
    """A ``doubleValue``: a JSON number, or a string proto3 JSON allows ("NaN", "Infinity", "1.5")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise MalformedSpan(f"doubleValue must be a number, got {_kind(value)}")
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            raise MalformedSpan(f"doubleValue {value[:40]!r} is not a number") from None
        return value
    return float(value)


def _raw(value: Any) -> Any:
    """An AnyValue as a plain JSON-able Python value (for arrays and maps)."""
    value = _object(value, "attribute value")
    if not value:
        return None
    if "stringValue" in value:
        return _text(value["stringValue"], "stringValue")
    if "intValue" in value:
        return _int64(value["intValue"])
    if "doubleValue" in value:
        return _double(value["doubleValue"])
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
    kv = _object(kv, "attribute")
    key = kv.get("key")
    if not isinstance(key, str):
        raise MalformedSpan(f"attribute key must be text, got {_kind(key)}")
    return key


def _array_json(values: list) -> str:
    if not values:
        return "[]"
    first = values[0]
    # Fast paths for the per-token arrays: homogeneous ints or doubles.  (An element of another
    # shape raises here, and rows_from_request reports it as a malformed span.)
    if isinstance(first, dict) and "intValue" in first and all(["intValue" in v for v in values]):
        numbers = list(map(int, [v["intValue"] for v in values]))
        if min(numbers) < INT64_MIN or max(numbers) > INT64_MAX:
            raise OutOfRange("intValue in an array is outside the 64-bit integer range")
        return "[" + ",".join(map(str, numbers)) + "]"
    if isinstance(first, dict) and "doubleValue" in first and all(
            [type(v.get("doubleValue")) is float for v in values]):
        return _doubles_json([v["doubleValue"] for v in values])
    if all([type(v) is dict and type(v.get("stringValue")) is str for v in values]):  # e.g. block hashes
        plain = [v["stringValue"] for v in values]
        joined = "".join(plain)
        if joined.isalnum() and joined.isascii():  # hex and the like: nothing to escape
            return '["' + '","'.join(plain) + '"]'
    else:
        plain = [_raw(v) for v in values]
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False)


def _doubles_json(values: list[float]) -> str:
    """``[format_double(v), …]`` as one JSON array, formatted in C where no element needs more than repr."""
    text = ",".join(map(repr, values))
    if "e" in text or "n" in text:  # an exponent, nan or inf: Go spells those its own way
        return "[" + ",".join(map(format_double, values)) + "]"
    # Without an exponent, Go's form is repr's minus a trailing ".0".
    return "[" + (text + ",").replace(".0,", ",")[:-1] + "]"


if sys.version_info >= (3, 11):
    def _b64decode(data: str) -> bytes:
        return binascii.a2b_base64(data, strict_mode=True)  # what validate=True checks, in one C call
else:
    def _b64decode(data: str) -> bytes:
        return base64.b64decode(data, validate=True)


def _number_array(value: Any, typecode: str) -> tuple[Optional[str], Optional[array]]:
    """A per-token array attribute: its elements when they are plain finite numbers of ``typecode``
    (``(None, numbers)``), else the JSON text the Collector stores (``(text, None)``: the view decides)."""
    value = _object(value, "attribute value")
    if "bytesValue" in value:
        data = _text(value["bytesValue"], "bytesValue")
        try:
            numbers = unpack(_b64decode(data), typecode)
        except (binascii.Error, ValueError):
            raise MalformedSpan(f"packed array {data[:40]!r} is not base64 of whole 8-byte numbers") from None
        if typecode == FLOAT64 and not math.isfinite(sum(numbers)):  # a finite sum has no nan or inf in it
            if not all(map(math.isfinite, numbers)):  # nan or inf: the text their standard encoding becomes
                return _array_json([{"doubleValue": _non_finite(v)} for v in numbers]), None
        return None, numbers
    if "arrayValue" not in value:
        return value_as_string(value), None
    values = _array_values(value)
    if typecode == INT64 and all([type(v) is dict and "intValue" in v for v in values]):
        numbers = list(map(int, [v["intValue"] for v in values]))
        if numbers and (min(numbers) < INT64_MIN or max(numbers) > INT64_MAX):
            raise OutOfRange("intValue in an array is outside the 64-bit integer range")
        return None, array(INT64, numbers)
    if typecode == FLOAT64 and all([type(v) is dict and type(v.get("doubleValue")) is float for v in values]):
        doubles = [v["doubleValue"] for v in values]
        if all(map(math.isfinite, doubles)):
            return None, array(FLOAT64, doubles)
    return _array_json(values), None


def _numbers_json(numbers: array) -> str:
    """Plain numbers (an ``array`` of int64 or float64) as the Collector's JSON text."""
    if numbers.typecode == INT64:
        return "[" + ",".join(map(str, numbers)) + "]"
    return _doubles_json(numbers.tolist())


def _non_finite(value: float) -> Any:
    """A double as the standard OTLP/JSON encoding carries it (proto3 JSON spells non-finite ones as text)."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def span_attributes(attributes: Any, packed: bool = False,
                    dropped: Optional[list[str]] = None) -> tuple[dict[str, str], Optional[dict[str, array]]]:
    """A span's attributes as ``attributes_map`` gives them, and (with ``packed``) its per-token arrays as
    numbers, their values in the map left empty; ``None`` when any of them is not plain numbers, or they
    do not stand side by side in ``TOKEN_ARRAYS`` order (then every text is in the map).  ``dropped``: as
    for ``attributes_map``."""
    out: dict[str, str] = {}
    arrays: Optional[dict[str, array]] = {} if packed else None
    numbered: dict[str, array] = {}
    for kv in _list(attributes, "attributes"):
        # Most attributes are text or an integer: take those without the general path's calls (per
        # span they add up).  Every other shape, and every error, goes the general way below.
        if type(kv) is dict:
            key, value = kv.get("key"), kv.get("value")
            if type(key) is str and type(value) is dict and key not in PACKED_ARRAYS:
                if "stringValue" in value:
                    text = value["stringValue"]
                    if type(text) is str:
                        out[key] = text
                        continue
                elif "intValue" in value:
                    try:
                        out[key] = str(_int64(value["intValue"]))
                    except OutOfRange as exc:
                        _drop(key, dropped, out, exc)
                    continue
        key = _key(kv)
        typecode = PACKED_ARRAYS.get(key)
        try:
            if typecode is None:
                out[key] = value_as_string(kv.get("value"))
                continue
            text, numbers = _number_array(kv.get("value"), typecode)
        except OutOfRange as exc:
            _drop(key, dropped, out, exc)
            numbered.pop(key, None)
            continue
        if numbers is None:
            out[key] = text
            numbered.pop(key, None)  # a repeated key: the last value counts
            if key in TOKEN_ARRAYS:
                arrays = None
        else:
            out[key] = ""
            numbered[key] = numbers
    present = [key for key in TOKEN_ARRAYS if key in numbered] if arrays is not None else []
    if present:
        keys = list(out)
        first = keys.index(present[0])
        if keys[first:first + len(present)] == present:  # where the database puts their text back
            arrays = {key: numbered.pop(key) for key in present}
        else:
            arrays = None
    for key, numbers in numbered.items():
        out[key] = _numbers_json(numbers)
    return out, arrays


def value_as_string(value: Any) -> str:
    value = _object(value, "attribute value")
    if not value:
        return ""
    if "stringValue" in value:
        return _text(value["stringValue"], "stringValue")
    if "intValue" in value:
        return str(_int64(value["intValue"]))
    if "doubleValue" in value:
        v = _double(value["doubleValue"])
        if isinstance(v, str):
            return {"Infinity": "+Inf", "-Infinity": "-Inf"}.get(v, v)
        return format_double(v)
    if "boolValue" in value:
        return "true" if value["boolValue"] else "false"
    if "arrayValue" in value:
        return _array_json(_array_values(value))
    if "kvlistValue" in value or "bytesValue" in value:
        raw = _raw(value)
        return raw if isinstance(raw, str) else json.dumps(raw, separators=(",", ":"), ensure_ascii=False)
    raise MalformedSpan(f"unknown attribute value type {sorted(value)}")


def attributes_map(attributes: Any, what: str = "attributes", dropped: Optional[list[str]] = None) -> dict[str, str]:
    """Attributes as the Collector's map of text.  An integer outside int64 raises ``OutOfRange``; with a
    ``dropped`` list its attribute is left out instead and its key added to the list."""
    out: dict[str, str] = {}
    for kv in _list(attributes, what):
        key = _key(kv)
        try:
            out[key] = value_as_string(kv.get("value"))
        except OutOfRange as exc:
            _drop(key, dropped, out, exc)
    return out


def _drop(key: str, dropped: Optional[list[str]], out: dict, exc: OutOfRange) -> None:
    """Leave out an attribute whose value does not fit (raising ``exc`` when the caller counts none)."""
    if dropped is None:
        raise exc
    dropped.append(key)
    out.pop(key, None)  # a repeated key: the last value counts, and it is left out


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


def rows_from_request(request: Any, packed: bool = False, dropped: Optional[list[str]] = None) -> list[SpanRow]:
    """One ``otel_traces`` row (values in ``COLUMNS`` order) per span of an export request.

    With ``packed``, the rows of request spans whose per-token arrays can go to the database as numbers
    carry them (``SpanRow.arrays``, see the module doc); every other row is complete.

    Anything that does not fit the table (a wrong shape or type, an id that is not 8/16 bytes, an
    integer outside int64, a time outside what ``DateTime64(9)`` holds) raises ``MalformedSpan``
    naming the field, so the caller can quarantine the whole request.  With a ``dropped`` list, one
    attribute's value is no reason to lose a request that may hold many spans: an attribute whose
    integer is outside int64 is left out of its span and its key added to the list.
    """
    if not isinstance(request, dict) or "resourceSpans" not in request:
        raise MalformedSpan("not an OTLP trace export request (no resourceSpans)")
    rows = []
    try:
        for resource_spans in _list(request["resourceSpans"], "resourceSpans"):
            resource_spans = _object(resource_spans, "resourceSpans[]")
            resource = _object(resource_spans.get("resource"), "resource")
            resource_attrs = attributes_map(resource.get("attributes"), "resource.attributes", dropped)
            service = resource_attrs.get("service.name", "")
            scopes = resource_spans.get("scopeSpans") or resource_spans.get("instrumentationLibrarySpans")
            for scope_spans in _list(scopes, "scopeSpans"):
                scope_spans = _object(scope_spans, "scopeSpans[]")
                scope = _object(scope_spans.get("scope") or scope_spans.get("instrumentationLibrary"), "scope")
                scope_name, scope_version = _text(scope.get("name"), "scope.name"), _text(scope.get("version"),
                                                                                          "scope.version")
                for span in _list(scope_spans.get("spans"), "spans"):
                    rows.append(_span_row(_object(span, "span"), service, resource_attrs, scope_name,
                                          scope_version, packed, dropped))
    except MalformedSpan:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        # A shape the checks above did not foresee: still this request's fault, never the caller's.
        raise MalformedSpan(f"unexpected shape: {type(exc).__name__}: {exc}") from None
    return rows


def _span_row(span: dict, service: str, resource_attrs: dict, scope_name: str, scope_version: str,
              packed: bool, dropped: Optional[list[str]]) -> SpanRow:
    start = _nanos(span.get("startTimeUnixNano"), "startTimeUnixNano")
    end = _nanos(span.get("endTimeUnixNano"), "endTimeUnixNano") or start
    events = [_object(e, "events[]") for e in _list(span.get("events"), "events")]
    links = [_object(link, "links[]") for link in _list(span.get("links"), "links")]
    status = _object(span.get("status"), "status")
    name = _text(span.get("name"), "name")
    attributes, arrays = span_attributes(span.get("attributes"), packed and name == sc.SPAN_REQUEST, dropped)
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
        [_text(e.get("name"), "events[].name") for e in events],
        [attributes_map(e.get("attributes"), "events[].attributes", dropped) for e in events],
        [_hex_id(link.get("traceId"), 16, "links[].traceId") for link in links],
        [_hex_id(link.get("spanId"), 8, "links[].spanId") for link in links],
        [_text(link.get("traceState"), "links[].traceState") for link in links],
        [attributes_map(link.get("attributes"), "links[].attributes", dropped) for link in links],
    ], arrays)
