"""OTLP/JSON ``ExportTraceServiceRequest`` lines → rows of ``otel_traces``, checked field by field.

msgspec decodes a line into the structs below: every field's JSON type is checked in C, and
``bytesValue`` is base64-decoded there. Attribute values become text as the OpenTelemetry
Collector's ClickHouse exporter writes them (numbers as text, booleans ``true``/``false``, arrays
and maps as JSON, bytes as base64), so the views read either writer's rows alike. With
``typed=True`` (ingest), a ``kvtrace.request`` span's per-token arrays (``tables.TOKEN_ARRAYS``) go to
``SpanRow.arrays`` instead of text: packed ones (``kvtrace/recording/packed_arrays.py``) as their bytes,
standard ones of older spools as numpy, read number by number; and every span ingest writes typed rows
for is marked ``TYPED_ROWS_STORED``.
"""

from __future__ import annotations

import base64
import json
import math
from typing import NamedTuple, Optional, Union

import msgspec
import numpy as np

from kvtrace import semconv as sc
from kvtrace.collectors.tables import TOKEN_ARRAYS
from kvtrace.recording.packed_arrays import INT64, PACKED_ARRAYS
from kvtrace.timestamps import LATEST_NS, ImplausibleTime, unix_nanos


class OtelRow(NamedTuple):
    """One ``otel_traces`` row, a field per column (``Events.Name`` as ``Events_Name``)."""

    Timestamp: int
    TraceId: str
    SpanId: str
    ParentSpanId: str
    TraceState: str
    SpanName: str
    SpanKind: str
    ServiceName: str
    ResourceAttributes: dict[str, str]
    ScopeName: str
    ScopeVersion: str
    SpanAttributes: dict[str, str]
    Duration: int
    StatusCode: str
    StatusMessage: str
    Events_Timestamp: list[int]
    Events_Name: list[str]
    Events_Attributes: list[dict[str, str]]
    Links_TraceId: list[str]
    Links_SpanId: list[str]
    Links_TraceState: list[str]
    Links_Attributes: list[dict[str, str]]


class SpanRow(OtelRow):
    """An ``OtelRow``, and read with ``typed=True`` a request span's per-token arrays by ``kvtrace_requests``
    column (absent arrays absent) in ``arrays``, else ``None``."""

    arrays: Optional[dict[str, Union[bytes, np.ndarray]]] = None


COLUMNS = [field.replace("_", ".") for field in OtelRow._fields]
"""``otel_traces``' column names (none of them holds an underscore)."""
SPAN_KINDS = ("SPAN_KIND_UNSPECIFIED", "SPAN_KIND_INTERNAL", "SPAN_KIND_SERVER", "SPAN_KIND_CLIENT",
              "SPAN_KIND_PRODUCER", "SPAN_KIND_CONSUMER")
STATUS_CODES = ("STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DTYPES = {INT64: np.dtype("<i8"), "d": np.dtype("<f8")}
Number = Union[int, float, str]  # proto3 JSON writes int64 as a decimal string, NaN and the infinities as text


class MalformedSpan(ValueError):
    """A line that is not an OTLP trace request kvtrace can store."""


class OutOfRange(MalformedSpan):
    """One attribute value that does not fit (an integer outside int64, a per-token array of other
    elements): with a ``dropped`` list the attribute is left out, the span kept."""


# gc=False: the decoded structs hold no reference cycles, and untracked objects are cheaper to make.
class AnyValue(msgspec.Struct, gc=False):
    stringValue: Optional[str] = None
    boolValue: Optional[bool] = None
    intValue: Union[int, str, None] = None
    doubleValue: Optional[Number] = None
    bytesValue: Optional[bytes] = None
    arrayValue: Optional[ArrayValue] = None
    kvlistValue: Optional[KeyValueList] = None


class KeyValue(msgspec.Struct, gc=False):
    key: str
    value: AnyValue = msgspec.field(default_factory=AnyValue)


class ArrayValue(msgspec.Struct, gc=False):
    values: list[AnyValue] = []


class KeyValueList(msgspec.Struct, gc=False):
    values: list[KeyValue] = []


class Event(msgspec.Struct, gc=False):
    timeUnixNano: Optional[Number] = None
    name: str = ""
    attributes: list[KeyValue] = []


class Link(msgspec.Struct, gc=False):
    traceId: str = ""
    spanId: str = ""
    traceState: str = ""
    attributes: list[KeyValue] = []


class Status(msgspec.Struct, gc=False):
    code: Union[int, str] = 0
    message: str = ""


class Span(msgspec.Struct, gc=False):
    traceId: str = ""
    spanId: str = ""
    parentSpanId: str = ""
    traceState: str = ""
    name: str = ""
    kind: Union[int, str] = 0
    startTimeUnixNano: Optional[Number] = None
    endTimeUnixNano: Optional[Number] = None
    attributes: list[KeyValue] = []
    events: list[Event] = []
    links: list[Link] = []
    status: Status = msgspec.field(default_factory=Status)


class Scope(msgspec.Struct, gc=False):
    name: str = ""
    version: str = ""


class ScopeSpans(msgspec.Struct, gc=False):
    scope: Optional[Scope] = None
    instrumentationLibrary: Optional[Scope] = None  # the name before OTLP 0.15
    spans: list[Span] = []


class Resource(msgspec.Struct, gc=False):
    attributes: list[KeyValue] = []


class ResourceSpans(msgspec.Struct, gc=False):
    resource: Resource = msgspec.field(default_factory=Resource)
    scopeSpans: list[ScopeSpans] = []
    instrumentationLibrarySpans: list[ScopeSpans] = []


class ExportRequest(msgspec.Struct, gc=False):
    resourceSpans: list[ResourceSpans]


_DECODE = msgspec.json.Decoder(ExportRequest).decode
_JSON = msgspec.json.Encoder().encode


def decode(line: Union[bytes, str, memoryview]) -> ExportRequest:
    """One line as an export request; ``MalformedSpan`` saying what is wrong and where."""
    try:
        return _DECODE(line)
    except msgspec.ValidationError as exc:
        raise MalformedSpan(f"not an OTLP/JSON trace request: {exc}") from None
    except msgspec.DecodeError as exc:
        try:
            json.loads(line if isinstance(line, (str, bytes)) else bytes(line))
        except (ValueError, RecursionError) as python_exc:
            raise MalformedSpan(f"not JSON: {python_exc}") from None
        # JSON to Python, not to a strict parser: a lone surrogate, NaN or Infinity no database can store.
        raise MalformedSpan(f"not JSON ingest can store (a lone surrogate, NaN or Infinity?): {exc}") from None


def _int64(value: Union[int, str]) -> int:
    if type(value) is str:
        try:
            value = int(value)
        except ValueError:
            raise MalformedSpan(f"intValue {value[:40]!r} is not an integer") from None
    if not INT64_MIN <= value <= INT64_MAX:
        raise OutOfRange(f"intValue {value} is outside the 64-bit integer range")
    return value


def _double(value: Number) -> float:
    try:
        return float(value)  # proto3 JSON's text: "NaN", "Infinity", "-Infinity", "1.5"
    except ValueError:
        raise MalformedSpan(f"doubleValue {value[:40]!r} is not a number") from None


def _double_text(value: float) -> str:
    return repr(value) if math.isfinite(value) else "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"


def _raw(value: AnyValue):
    """An AnyValue as a plain JSON-able Python value (for arrays and maps)."""
    if value.stringValue is not None:
        return value.stringValue
    if value.bytesValue is not None:
        return base64.b64encode(value.bytesValue).decode()
    if value.intValue is not None:
        return _int64(value.intValue)
    if value.doubleValue is not None:  # proto3 JSON's text for NaN and the infinities stays text
        number = _double(value.doubleValue)
        return value.doubleValue if type(value.doubleValue) is str else number
    if value.boolValue is not None:
        return value.boolValue
    if value.arrayValue is not None:
        return [_raw(v) for v in value.arrayValue.values]
    if value.kvlistValue is not None:
        return {kv.key: _raw(kv.value) for kv in value.kvlistValue.values}
    return None


def value_as_string(value: AnyValue) -> str:
    """An attribute value as the Collector's text."""
    if value.stringValue is not None:
        return value.stringValue
    if value.intValue is not None:
        return str(_int64(value.intValue))
    if value.doubleValue is not None:
        return _double_text(_double(value.doubleValue))
    if value.boolValue is not None:
        return "true" if value.boolValue else "false"
    if value.arrayValue is not None and all([v.stringValue is not None for v in value.arrayValue.values]):
        return _JSON([v.stringValue for v in value.arrayValue.values]).decode()  # e.g. block hashes
    raw = _raw(value)
    return "" if raw is None else raw if isinstance(raw, str) else _JSON(raw).decode()


def numbers(value: AnyValue, typecode: str) -> np.ndarray:
    """A per-token array attribute as int64 / float64: packed bytes viewed in place, a standard array
    read number by number (``OutOfRange`` when its elements are not numbers of the type)."""
    dtype = _DTYPES[typecode]
    if value.bytesValue is not None:
        if len(value.bytesValue) % 8:
            raise MalformedSpan(f"packed array of {len(value.bytesValue)} bytes is not base64 of whole 8-byte numbers")
        return np.frombuffer(value.bytesValue, dtype)
    if value.arrayValue is None:
        raise OutOfRange("a per-token array must be an arrayValue or packed bytesValue")
    elements = [v.intValue if typecode == INT64 else v.doubleValue for v in value.arrayValue.values]
    try:
        if None in elements:
            raise MalformedSpan("an element of another type")
        return np.array([_int64(e) if typecode == INT64 else _double(e) for e in elements], dtype)
    except MalformedSpan as exc:
        raise OutOfRange(f"a per-token array holds a value that is not {dtype}: {exc}") from None


_LEFT_OUT = object()
"""What ``_text_of`` gives for an attribute that is not text of the span (a typed array, a dropped value)."""


def span_attributes(attributes: list[KeyValue], arrays: Optional[dict] = None,
                    dropped: Optional[list[str]] = None) -> dict[str, str]:
    """Attributes as text by key (a repeated key: the last counts); with ``arrays`` (a request span read
    typed), its per-token arrays go there by column instead. ``dropped``: see ``rows_from_request``."""
    # One comprehension with text inline: per span this loop is most of ingest's Python time.
    out = {kv.key: text if (text := kv.value.stringValue) is not None else _text_of(kv, arrays, dropped)
           for kv in attributes}
    if _LEFT_OUT in out.values():
        out = {key: text for key, text in out.items() if text is not _LEFT_OUT}
    return out


def _text_of(kv: KeyValue, arrays: Optional[dict], dropped: Optional[list[str]]):
    """A value that is not ``stringValue``: its text, or ``_LEFT_OUT`` when it went to ``arrays`` or was dropped."""
    key, value = kv.key, kv.value
    if type(number := value.intValue) is str and number.isascii() and number.isdigit() and len(number) < 19:
        return number if number[0] != "0" or len(number) == 1 else str(int(number))  # below 10**18: inside int64
    try:
        typecode = PACKED_ARRAYS.get(key)
        if typecode is None:
            return value_as_string(value)
        if arrays is not None and key in TOKEN_ARRAYS:
            packed = value.bytesValue  # kept as bytes: store.py views a column's arrays at once
            arrays[TOKEN_ARRAYS[key]] = numbers(value, typecode) if packed is None or len(packed) % 8 else packed
            return _LEFT_OUT
        if value.bytesValue is not None:  # e.g. packed prompt ids: the Collector's JSON text
            return "[" + ",".join(map(str if typecode == INT64 else _double_text,
                                      numbers(value, typecode).tolist())) + "]"
        return value_as_string(value)
    except OutOfRange:
        if dropped is None:
            raise
        dropped.append(key)
        if arrays is not None:
            arrays.pop(TOKEN_ARRAYS.get(key, ""), None)
        return _LEFT_OUT


def _hex_id(value: str, nbytes: int, what: str) -> str:
    """OTLP/JSON ids are hex; protobuf's generic JSON mapping writes base64. Accept both."""
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
    except ValueError:
        raise MalformedSpan(f"{what} {value[:60]!r} is neither hex nor base64") from None
    if len(raw) != nbytes:
        raise MalformedSpan(f"{what} {value[:60]!r} has {len(raw)} bytes, expected {nbytes}")
    return raw.hex()


def _enum(value: Union[int, str], names: tuple[str, ...]) -> str:
    if isinstance(value, str):
        return value if value in names else names[0]
    return names[value] if 0 <= value < len(names) else names[0]


def _nanos(value: Optional[Number], what: str) -> int:
    if type(value) is str and value.isascii() and value.isdigit() and (number := int(value)) <= LATEST_NS:
        return number  # proto3 JSON's decimal text, the common case
    try:
        return unix_nanos(value, what)
    except ImplausibleTime as exc:
        raise MalformedSpan(str(exc)) from None


def rows_from_request(line: Union[bytes, str], typed: bool = False, dropped: Optional[list[str]] = None) -> list[SpanRow]:
    """One ``otel_traces`` row per span of an export request line (``typed``: see the module doc).

    Anything that does not fit the table (a wrong shape or type, an id that is not 8/16 bytes, a time
    outside what ``DateTime64(9)`` holds) raises ``MalformedSpan`` naming the field, so the caller can
    quarantine the line. With a ``dropped`` list one value is no reason to lose a request that may
    hold many spans: an attribute that does not fit (``OutOfRange``) is left out and its key listed.
    """
    rows = []
    for resource_spans in decode(line).resourceSpans:
        resource_attrs = span_attributes(resource_spans.resource.attributes, dropped=dropped)
        for scope_spans in resource_spans.scopeSpans or resource_spans.instrumentationLibrarySpans:
            scope = scope_spans.scope or scope_spans.instrumentationLibrary or Scope()
            head = (resource_attrs.get("service.name", ""), resource_attrs, scope.name, scope.version)
            rows.extend(_span_row(span, head, typed, dropped) for span in scope_spans.spans)
    return rows


def _span_row(span: Span, head: tuple, typed: bool, dropped: Optional[list[str]]) -> SpanRow:
    service, resource_attrs, scope_name, scope_version = head
    start = _nanos(span.startTimeUnixNano, "startTimeUnixNano")
    end = _nanos(span.endTimeUnixNano, "endTimeUnixNano") or start
    arrays = {} if typed and span.name == sc.SPAN_REQUEST else None
    attributes = span_attributes(span.attributes, arrays, dropped)
    event_names = [e.name for e in span.events]
    if arrays is not None or (typed and any(n.startswith(sc.CACHE_EVENT_PREFIX) for n in event_names)):
        attributes[sc.TYPED_ROWS_STORED] = "true"
    links = span.links
    row = SpanRow(
        Timestamp=start, TraceId=_hex_id(span.traceId, 16, "traceId"), SpanId=_hex_id(span.spanId, 8, "spanId"),
        ParentSpanId=_hex_id(span.parentSpanId, 8, "parentSpanId"), TraceState=span.traceState, SpanName=span.name,
        SpanKind=_enum(span.kind, SPAN_KINDS), ServiceName=service, ResourceAttributes=resource_attrs,
        ScopeName=scope_name, ScopeVersion=scope_version, SpanAttributes=attributes, Duration=max(0, end - start),
        StatusCode=_enum(span.status.code, STATUS_CODES), StatusMessage=span.status.message,
        Events_Timestamp=[_nanos(e.timeUnixNano, "events[].timeUnixNano") for e in span.events],
        Events_Name=event_names,
        Events_Attributes=[span_attributes(e.attributes, dropped=dropped) for e in span.events],
        Links_TraceId=[_hex_id(link.traceId, 16, "links[].traceId") for link in links],
        Links_SpanId=[_hex_id(link.spanId, 8, "links[].spanId") for link in links],
        Links_TraceState=[link.traceState for link in links],
        Links_Attributes=[span_attributes(link.attributes, dropped=dropped) for link in links])
    if arrays is not None:
        row.arrays = arrays
    return row
