"""Direct span writer: batches into a ClickHouse server, through the same write as ingest.

Used with ``KVTRACE_EXPORTER=clickhouse`` (found by ``recording/exporters`` through the
``kvtrace.exporters`` entry point), behind :class:`kvtrace.recording.exporters.delivery.SinkWithSpool`:
it runs on kvtrace's exporter thread, never on the engine's, and a batch the server does not take
within the connect / read time-outs raises here and goes to the spool there. Only servers: an
embedded (chDB) database belongs to the query side's process.
"""

from __future__ import annotations

from typing import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.collectors.otlp_rows import rows_from_request
from kvtrace.collectors.store import batch_token, store_rows
from kvtrace.db import server_client
from kvtrace.recording.exporters.otlp_json import encode_request, utf8_line


class ClickHouseSpanExporter(SpanExporter):
    def __init__(self, url: str, connect_timeout_s: float = 0.25, timeout_s: float = 0.5):
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._client = None
        self.count_repairs: Callable[[int], None] = lambda repaired: None
        """Told how many values of a stored batch were repaired (``SpanPipeline`` counts them)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Store ``spans``; raises when the server is unreachable, slow or refuses them."""
        if not spans:
            return SpanExportResult.SUCCESS
        # Repaired as ingest repairs a spool line: text UTF-8 cannot carry, a value that does not fit left out.
        line, repaired = utf8_line(encode_request(spans, packed=True))
        dropped: list[str] = []
        rows = rows_from_request(line, typed=True, dropped=dropped)
        try:
            if self._client is None:
                self._client = server_client(self.url, self.connect_timeout_s, self.timeout_s)
            store_rows(self._client, rows, batch_token(line.encode()))
        except Exception:
            self._close()  # the next attempt starts from a fresh connection
            raise
        if repaired or dropped:
            self.count_repairs(repaired + len(dropped))
        return SpanExportResult.SUCCESS

    def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def shutdown(self) -> None:
        self._close()
