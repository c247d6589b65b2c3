"""Where a batch of spans ends up, and the spool behind every remote sink.

kvtrace's exporters answer ``deliver(spans) -> Delivery`` so the pipeline can
count every span as stored, spooled or lost (a plain OpenTelemetry exporter
counts as stored when it reports success). A remote sink (a Collector, a
ClickHouse server) is wrapped in :class:`SinkWithSpool`: a batch the sink does
not take within its time-outs is written to the spool instead, and after a
failure the sink is left alone for ``retry_after_s``, so a dead or hung sink
costs one time-out, not one per batch.
"""

from __future__ import annotations

import enum
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from kvtrace.recording.exporters.spool import SpoolExporter

log = logging.getLogger("kvtrace")

SINK_RETRY_AFTER_S = 30.0


class Delivery(enum.Enum):
    STORED = "stored"      # the sink took the batch
    SPOOLED = "spooled"    # written to the spool, the configured destination
    FALLBACK = "fallback"  # written to the spool because the sink failed or did not answer in time
    LOST = "lost"          # nothing took it (counted as failed)


class FailureLog:
    """Logs when failures of one destination start and when they stop, never once per batch."""

    def __init__(self, what: str):
        self.what = what
        self.failed_batches = 0

    def failed(self, reason: str, consequence: str) -> None:
        if self.failed_batches == 0:
            log.warning("kvtrace: %s failed (%s); %s. Counters: `kvtrace db status`", self.what, reason, consequence)
        self.failed_batches += 1

    def succeeded(self) -> None:
        if self.failed_batches:
            log.warning("kvtrace: %s works again after %d failed batch(es)", self.what, self.failed_batches)
            self.failed_batches = 0


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class SinkWithSpool(SpanExporter):
    """A remote sink with the spool behind it."""

    def __init__(self, sink: SpanExporter, spool: "SpoolExporter", describe: str,
                 retry_after_s: float = SINK_RETRY_AFTER_S):
        self.sink = sink
        self.spool = spool
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._health = FailureLog(describe)

    @property
    def spool_directory(self) -> Path:
        return self.spool.spool_directory

    @property
    def count_repairs(self) -> Callable[[int], None]:
        return self.spool.count_repairs

    @count_repairs.setter
    def count_repairs(self, count: Callable[[int], None]) -> None:
        """Where the spool and the sink (when it repairs values too) count what they repaired."""
        self.spool.count_repairs = count
        if hasattr(self.sink, "count_repairs"):
            self.sink.count_repairs = count

    def deliver(self, spans: Sequence[ReadableSpan]) -> Delivery:
        if not spans:
            return Delivery.STORED
        if time.monotonic() >= self._down_until:
            try:
                ok = self.sink.export(spans) == SpanExportResult.SUCCESS
                reason = "refused, failed or not answered within its time-out"
            except Exception as exc:  # a sink must never take the exporter thread down
                ok, reason = False, first_line(exc)
            if ok:
                self._health.succeeded()
                return Delivery.STORED
            self._down_until = time.monotonic() + self.retry_after_s
            self._health.failed(reason, f"spans go to the spool {self.spool.spool_directory} "
                                        f"(sink retried every {self.retry_after_s:g} s)")
        return self.spool_directly(spans)

    def spool_directly(self, spans: Sequence[ReadableSpan], timeout: Optional[float] = None) -> Delivery:
        outcome = self.spool.deliver(spans, timeout)
        return Delivery.FALLBACK if outcome is Delivery.SPOOLED else outcome

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE if self.deliver(spans) is Delivery.LOST else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        try:
            self.sink.shutdown()
        except Exception:
            log.debug("kvtrace: sink shutdown failed", exc_info=True)
        self.spool.shutdown()
