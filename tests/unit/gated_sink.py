"""A span sink that holds each batch until its gate is set, as a slow sink does."""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class GatedExporter(InMemorySpanExporter):
    """Holds each batch until ``gate`` is set (clear at first)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def export(self, spans):
        self.gate.wait(60)
        return super().export(spans)
