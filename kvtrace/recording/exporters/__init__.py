"""Every exporter kvtrace can send spans through, and the choice among them.

* :mod:`.spool` — OTLP/JSON lines on local disk (the default; one file per process);
* ClickHouse — direct writes into a server (``kvtrace.collectors.sink``, by its ``kvtrace.exporters`` entry point);
* OTLP to an OpenTelemetry Collector (the SDK's own exporter);
* :mod:`.delivery` — a remote sink behind time-outs, spooling what it does not take;
* :mod:`.otlp_json` — the OTLP/JSON encoding the spool and the ClickHouse exporter share.
"""

from __future__ import annotations

import os

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.config import Settings
from kvtrace.db import describe
from kvtrace.recording.exporters.delivery import SinkWithSpool
from kvtrace.recording.exporters.spool import SpoolExporter


class DiscardExporter(SpanExporter):
    """``KVTRACE_EXPORTER=none``: spans are recorded (and counted) but sent nowhere."""

    def export(self, spans):
        return SpanExportResult.SUCCESS


def build_exporter(settings: Settings):
    """The exporter chosen by ``KVTRACE_EXPORTER`` (spool by default); remote sinks spool what they miss."""
    spool = SpoolExporter(settings.spool_dir, settings.spool_rotate_bytes)
    if settings.exporter == "spool":
        return spool
    if settings.exporter == "otlp":
        # Imported only when chosen: the OTLP/protobuf stack costs import time in every engine process.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or "http://localhost:4318")
        sink = OTLPSpanExporter(timeout=settings.export_timeout_s)  # seconds: the SDK's unit
        return SinkWithSpool(sink, spool, f"sending spans to the OpenTelemetry Collector at {endpoint}")
    if settings.exporter == "clickhouse":
        # Loaded only when chosen (clickhouse-connect is heavy), by entry point: the sink is collectors', and
        # recording imports nothing of collectors.
        from importlib.metadata import entry_points

        (found,) = entry_points(group="kvtrace.exporters", name="clickhouse")
        sink = found.load()(settings.clickhouse_url, connect_timeout_s=settings.connect_timeout_s,
                            timeout_s=settings.export_timeout_s)
        return SinkWithSpool(sink, spool, f"inserting spans into ClickHouse at {describe(settings.clickhouse_url)}")
    return DiscardExporter()
