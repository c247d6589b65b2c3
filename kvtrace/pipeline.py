"""Span pipeline: a bounded queue and one background thread per process.

The engine thread only appends to a deque (never blocks, never raises); a
worker thread hands batches to the exporter.  When the queue is full the span
is dropped *and counted*; when the exporter fails the batch is counted as
failed.  Counters are published to the spool's ``stats/`` directory so
``kvtrace db status`` can report them for every process.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("kvtrace")


class SpanPipeline(SpanProcessor):
    def __init__(
        self,
        exporter: SpanExporter,
        max_queue_size: int = 2048,
        max_batch_size: int = 512,
        schedule_delay_ms: int = 1000,
        publish_stats: Optional[Callable[[dict], None]] = None,
    ):
        self.exporter = exporter
        self.max_queue_size = max(1, max_queue_size)
        self.max_batch_size = max(1, max_batch_size)
        self.schedule_delay = max(0.001, schedule_delay_ms / 1000)
        self._publish_stats = publish_stats
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._stopped = False
        self.counters = {"spans_queued": 0, "spans_exported": 0, "spans_dropped_queue_full": 0,
                         "spans_failed_export": 0, "spans_spooled_fallback": 0,
                         "instrumentation_errors": 0}
        self._worker = threading.Thread(target=self._run, name="kvtrace-exporter", daemon=True)
        self._worker.start()

    # --- engine side -----------------------------------------------------------

    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - SDK hook
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopped:
            self.counters["spans_dropped_queue_full"] += 1
            return
        if len(self._queue) >= self.max_queue_size:
            self.counters["spans_dropped_queue_full"] += 1
            return
        self._queue.append(span)
        self.counters["spans_queued"] += 1
        if len(self._queue) >= self.max_batch_size:
            self._wake.set()

    # --- worker side -------------------------------------------------------------

    def _run(self) -> None:
        last_stats = 0.0
        while True:
            self._wake.wait(self.schedule_delay)
            self._wake.clear()
            self._drain()
            now = time.monotonic()
            if now - last_stats > 5 or self._stopped:
                self._emit_stats()
                last_stats = now
            if self._stopped and not self._queue:
                return

    def _drain(self) -> None:
        while self._queue:
            batch = []
            with self._idle:
                while self._queue and len(batch) < self.max_batch_size:
                    batch.append(self._queue.popleft())
                self._in_flight = len(batch)
            try:
                result = self.exporter.export(batch)
            except Exception:  # the exporter must never take the worker down
                log.exception("kvtrace: exporter raised; %d spans counted as failed", len(batch))
                result = SpanExportResult.FAILURE
            if result == SpanExportResult.SUCCESS:
                self.counters["spans_exported"] += len(batch)
            else:
                self.counters["spans_failed_export"] += len(batch)
            with self._idle:
                self._in_flight = 0
                self._idle.notify_all()

    def _emit_stats(self) -> None:
        if self._publish_stats is None:
            return
        fallback = getattr(self.exporter, "spooled_fallback", None)
        if fallback is not None:
            self.counters["spans_spooled_fallback"] = fallback
        try:
            self._publish_stats(dict(self.counters))
        except Exception:
            log.debug("kvtrace: could not publish stats", exc_info=True)

    # --- lifecycle -------------------------------------------------------------------

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        self._wake.set()
        with self._idle:
            while self._queue or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.set()
                self._idle.wait(min(remaining, 0.05))
        self._emit_stats()
        return True

    def shutdown(self) -> None:
        if self._stopped:
            return
        self.force_flush(10000)
        self._stopped = True
        self._wake.set()
        self._worker.join(timeout=10)
        self._emit_stats()
        try:
            self.exporter.shutdown()
        except Exception:
            log.debug("kvtrace: exporter shutdown failed", exc_info=True)


def stats_publisher(spool_dir: Path, process_tag: Callable[[], str]) -> Callable[[dict], None]:
    from kvtrace.spool import write_stats

    return lambda counters: write_stats(spool_dir, process_tag(), counters)
