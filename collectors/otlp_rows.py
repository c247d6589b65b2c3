"""OTLP/JSON ``ExportTraceServiceRequest`` → rows of ``otel_traces``.

Values are stringified the way the OpenTelemetry Collector's ClickHouse
exporter does it (``pcommon.Value.AsString``): numbers as text, booleans as
``true``/``false``, arrays and maps as JSON, bytes as base64.  Doubles use the
shortest round-trip form, so float margins survive bit-exact.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any, Iterator

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


class MalformedSpan(ValueError):
    """A line that is JSON but not an OTLP trace request kvtrace can store."""


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
            from decimal import Decimal

            return format(Decimal(text), "f")
        mantissa, exponent = text.split("e")
        sign = "-" if exponent.startswith("-") else "+"
        return f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"
    return text


def _raw(value: dict) -> Any:
    """An AnyValue as a plain JSON-able Python value (for arrays and maps)."""
    if not value:
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        v = value["doubleValue"]
        return float(v) if not isinstance(v, str) else v
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_raw(v) for v in (value["arrayValue"] or {}).get("values", ())]
    if "kvlistValue" in value:
        return {kv["key"]: _raw(kv.get("value") or {}) for kv in (value["kvlistValue"] or {}).get("values", ())}
    if "bytesValue" in value:
        return value["bytesValue"]
    raise MalformedSpan(f"unknown attribute value type {sorted(value)}")


def _array_json(values: list) -> str:
    if not values:
        return "[]"
    first = values[0]
    # Fast paths for the per-token arrays: homogeneous ints or doubles.
    if "intValue" in first and all("intValue" in v for v in values):
        return "[" + ",".join([str(int(v["intValue"])) for v in values]) + "]"
    if "doubleValue" in first and all(not isinstance(v.get("doubleValue"), str) for v in values):
        return "[" + ",".join([format_double(v["doubleValue"]) for v in values]) + "]"
    return json.dumps([_raw(v) for v in values], separators=(",", ":"), ensure_ascii=False)


def value_as_string(value: dict) -> str:
    if not value:
        return ""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return str(int(value["intValue"]))
    if "doubleValue" in value:
        v = value["doubleValue"]
        if isinstance(v, str):
            return {"Infinity": "+Inf", "-Infinity": "-Inf"}.get(v, v)
        return format_double(v)
    if "boolValue" in value:
        return "true" if value["boolValue"] else "false"
    if "arrayValue" in value:
        return _array_json((value["arrayValue"] or {}).get("values", []))
    if "kvlistValue" in value or "bytesValue" in value:
        raw = _raw(value)
        return raw if isinstance(raw, str) else json.dumps(raw, separators=(",", ":"), ensure_ascii=False)
    raise MalformedSpan(f"unknown attribute value type {sorted(value)}")


def attributes_map(attributes: list | None) -> dict[str, str]:
    if not attributes:
        return {}
    return {kv["key"]: value_as_string(kv.get("value") or {}) for kv in attributes}


def _hex_id(value: str | None, nbytes: int) -> str:
    """OTLP/JSON ids are hex; protobuf's generic JSON mapping writes base64.  Accept both."""
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
        raise MalformedSpan(f"id {value!r} is neither hex nor base64") from None
    if len(raw) != nbytes:
        raise MalformedSpan(f"id {value!r} has {len(raw)} bytes, expected {nbytes}")
    return raw.hex()


def _enum(value: Any, names: tuple[str, ...]) -> str:
    if isinstance(value, str):
        return value if value in names else names[0]
    try:
        return names[int(value or 0)]
    except (IndexError, ValueError, TypeError):
        return names[0]


def _nanos(value: Any) -> int:
    return int(value or 0)


def rows_from_request(request: dict) -> Iterator[list]:
    """Yield one ``otel_traces`` row (values in ``COLUMNS`` order) per span."""
    if not isinstance(request, dict) or "resourceSpans" not in request:
        raise MalformedSpan("not an OTLP trace export request (no resourceSpans)")
    for resource_spans in request.get("resourceSpans") or ():
        resource_attrs = attributes_map((resource_spans.get("resource") or {}).get("attributes"))
        service = resource_attrs.get("service.name", "")
        for scope_spans in resource_spans.get("scopeSpans") or resource_spans.get("instrumentationLibrarySpans") or ():
            scope = scope_spans.get("scope") or scope_spans.get("instrumentationLibrary") or {}
            scope_name, scope_version = scope.get("name", ""), scope.get("version", "")
            for span in scope_spans.get("spans") or ():
                yield _span_row(span, service, resource_attrs, scope_name, scope_version)


def _span_row(span: dict, service: str, resource_attrs: dict, scope_name: str, scope_version: str) -> list:
    try:
        start = _nanos(span.get("startTimeUnixNano"))
        end = _nanos(span.get("endTimeUnixNano")) or start
        events = span.get("events") or ()
        links = span.get("links") or ()
        status = span.get("status") or {}
        return [
            start,
            _hex_id(span.get("traceId"), 16),
            _hex_id(span.get("spanId"), 8),
            _hex_id(span.get("parentSpanId"), 8),
            span.get("traceState", ""),
            span.get("name", ""),
            _enum(span.get("kind"), SPAN_KINDS),
            service,
            resource_attrs,
            scope_name,
            scope_version,
            attributes_map(span.get("attributes")),
            max(0, end - start),
            _enum(status.get("code"), STATUS_CODES),
            status.get("message", ""),
            [_nanos(e.get("timeUnixNano")) for e in events],
            [e.get("name", "") for e in events],
            [attributes_map(e.get("attributes")) for e in events],
            [_hex_id(link.get("traceId"), 16) for link in links],
            [_hex_id(link.get("spanId"), 8) for link in links],
            [link.get("traceState", "") for link in links],
            [attributes_map(link.get("attributes")) for link in links],
        ]
    except MalformedSpan:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise MalformedSpan(f"span field has an unexpected shape: {exc}") from None
