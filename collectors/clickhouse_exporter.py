"""Direct span writer: insert batches into a ClickHouse server, spool when it is unreachable.

Used with ``KVTRACE_EXPORTER=clickhouse``.  Runs on kvtrace's exporter
thread, never on the engine's.  When the server does not answer, the batch
goes to the spool (same OTLP/JSON lines ``kvtrace db ingest`` takes later) and
is counted in ``spooled_fallback``; after a failure the server is not retried
for ``retry_after_s`` so a dead database costs one timeout, not one per batch.
Only servers: an embedded (chDB) database belongs to the query side's process.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.collectors.otlp_rows import COLUMNS, rows_from_request
from kvtrace.errors import ConfigError
from kvtrace.otlp_json import encode_request

log = logging.getLogger("kvtrace")


class ClickHouseSpanExporter(SpanExporter):
    def __init__(self, url: str, fallback: SpanExporter, retry_after_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"KVTRACE_EXPORTER=clickhouse needs a ClickHouse server URL (http(s)://...), got {url!r}; "
                "engines write to the spool for the embedded database"
            )
        self.url = url
        self.fallback = fallback
        self.retry_after_s = retry_after_s
        self.spooled_fallback = 0
        self._client = None
        self._down_until = 0.0

    def _connect(self):
        if self._client is None:
            from kvtrace.db import connect

            self._client = connect(self.url)
        return self._client

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        if time.monotonic() >= self._down_until:
            try:
                rows = list(rows_from_request(json.loads(encode_request(spans))))
                self._connect().insert("otel_traces", rows, column_names=COLUMNS)
                return SpanExportResult.SUCCESS
            except Exception as exc:
                self._client = None
                self._down_until = time.monotonic() + self.retry_after_s
                log.warning("kvtrace: ClickHouse at %s unavailable (%s); spooling spans", self.url, exc)
        result = self.fallback.export(spans)
        if result == SpanExportResult.SUCCESS:
            self.spooled_fallback += len(spans)
        return result

    def shutdown(self) -> None:
        self.fallback.shutdown()
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    @property
    def writer(self):
        """The spool writer behind the fallback (for stats publishing)."""
        return getattr(self.fallback, "writer", None)
