"""Span pipeline: a bounded queue and one background thread per process.

The engine thread only appends to a deque (never blocks, never raises); a
worker thread hands batches to the exporter and counts where each batch
ended: stored, spooled, or lost (``kvtrace/recording/stats.py`` names the
counters and the equation they keep; ``counters.py`` holds them, under a
lock, for every thread that counts). A full queue drops *and counts*.

Shutdown is bounded by ``shutdown_timeout_s``: the worker first delivers as
usual (each sink has its own short time-outs); after half the time whatever
is still queued is written straight to the spool, even while the worker is
stuck in a sink; when the time is up, what is left (still queued, or in the
hands of a sink that does not return) is counted as dropped at shutdown and
the host is let go. The worker is a daemon thread, so it never holds up the
interpreter's exit; should its batch still arrive while the process lives,
the counters are corrected.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional, Union

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.recording.exporters.delivery import Delivery, FailureLog, first_line
from kvtrace.recording.counters import SpanCounters
from kvtrace.recording.stats import StatsFile, lost

log = logging.getLogger("kvtrace")

STATS_INTERVAL_S = 1.0
"""Counters are republished at most this often while they change (and always at flush and shutdown)."""

# How a span's end is counted: finished, and where it went, in one change (built once, not per span).
_QUEUED = {"spans_finished": 1, "spans_queued": 1}
_DROPPED_QUEUE_FULL = {"spans_finished": 1, "spans_dropped_queue_full": 1}
_DROPPED_CLOSING = {"spans_finished": 1, "spans_dropped_at_shutdown": 1}


class Deferred:
    """A span built on the worker thread: the engine's thread only queues ``build`` (the record's hashing
    and packing is most of what recording costs it). A build that fails is counted lost."""

    __slots__ = ("build",)

    def __init__(self, build: Callable[[], ReadableSpan]):
        self.build = build


class SpanPipeline(SpanProcessor):
    def __init__(
        self,
        exporter: SpanExporter,
        max_queue_size: int = 2048,
        max_batch_size: int = 512,
        schedule_delay_ms: int = 1000,
        shutdown_timeout_s: float = 2.0,
        stats: Optional[StatsFile] = None,
    ):
        self.exporter = exporter
        self.max_queue_size = max(1, max_queue_size)
        self.max_batch_size = max(1, max_batch_size)
        self.schedule_delay = max(0.001, schedule_delay_ms / 1000)
        self.shutdown_timeout_s = max(0.0, shutdown_timeout_s)
        self.stats = stats
        self.counters = SpanCounters()
        self._queue: collections.deque[Union[ReadableSpan, Deferred]] = collections.deque()
        self._wake = threading.Event()
        self._idle = False  # the worker waits for a first span, not a tick: on_end wakes it
        self._state = threading.Condition()  # guards _in_flight and _final; notified when a batch settles
        self._in_flight = 0
        self._closing = False   # shutdown has begun: new spans are not accepted
        self._spool_only = False  # second half of the shutdown: no more waiting on the sink
        self._final = False     # shutdown time is up: what is in flight was counted as dropped
        self._exporter_errors = FailureLog("kvtrace's exporter")
        self._published: dict = {}
        self._publishing = threading.Lock()
        if hasattr(exporter, "count_repairs"):  # kvtrace's exporters repair client values they cannot write
            exporter.count_repairs = self.count_repairs
        self._worker = threading.Thread(target=self._run, name="kvtrace-exporter", daemon=True)
        self._worker.start()

    # --- engine side -----------------------------------------------------------

    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - SDK hook
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._closing:
            self.counters.apply(_DROPPED_CLOSING)
            return
        if len(self._queue) >= self.max_queue_size:
            self.counters.apply(_DROPPED_QUEUE_FULL)
            return
        self.counters.apply(_QUEUED)  # before the worker can take it: a snapshot never shows it settled unqueued
        self._queue.append(span)
        if self._idle or len(self._queue) >= self.max_batch_size:
            self._idle = False
            self._wake.set()

    def count_repairs(self, repaired: int) -> None:
        """Count values a span keeps in a repaired form (the recorder's, and exporters' on their threads)."""
        self.counters.add("values_repaired", repaired)

    # --- worker side -------------------------------------------------------------

    def _run(self) -> None:
        # Ticks of schedule_delay while spans come; after a tick that found none, one wait until the next
        # span (or the counters' interval). Each wake retakes the GIL from an engine thread that lets it go
        # at every torch call: 50-270 us of this thread's CPU a wake under vLLM (docs/findings.md).
        last_stats, quiet = 0.0, False
        idle_wait = max(STATS_INTERVAL_S, self.schedule_delay)
        while not self._final:
            if quiet:
                self._idle = True  # before the look at the queue: a span queued after the look wakes the wait
                self._idle = not (self._queue or self._closing)
            self._wake.wait(idle_wait if self._idle else self.schedule_delay)
            self._wake.clear()
            self._idle = False
            quiet = not self._queue
            self._drain()
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                self._publish()
                last_stats = now
            if self._closing and not self._queue:
                return

    def _take_batch(self) -> list[Union[ReadableSpan, Deferred]]:
        with self._state:
            batch = []
            while self._queue and len(batch) < self.max_batch_size:
                batch.append(self._queue.popleft())
            self._in_flight += len(batch)
            return batch

    def _drain(self) -> None:
        while self._queue and not self._final:
            batch = self._take_batch()
            if batch:
                batch = self._built(batch)
                self._settle(batch, self._deliver(batch))

    def _built(self, batch: list) -> list[ReadableSpan]:
        """The batch with its deferred spans built; those that fail to build are settled as lost."""
        spans, failed = [], 0
        for item in batch:
            if type(item) is not Deferred:
                spans.append(item)
                continue
            try:
                spans.append(item.build())
            except Exception:
                failed += 1
                log.exception("kvtrace: could not build a request span")
        if failed:
            self.counters.add("instrumentation_errors", failed)
            self._settle([None] * failed, Delivery.LOST)
        return spans

    def _deliver(self, batch: list[ReadableSpan], timeout: Optional[float] = None) -> Delivery:
        try:
            if self._spool_only or timeout is not None:  # only set for an exporter with a spool
                return self.exporter.spool_directly(batch, timeout)
            deliver = getattr(self.exporter, "deliver", None)
            if deliver is not None:
                return deliver(batch)
            ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
            return Delivery.STORED if ok else Delivery.LOST
        except Exception as exc:  # the exporter must never take the worker down
            self._exporter_errors.failed(first_line(exc), "those spans are counted as failed")
            return Delivery.LOST

    def _settle(self, batch: list[ReadableSpan], outcome: Delivery) -> None:
        n = len(batch)
        if outcome is Delivery.STORED:
            deltas = {"spans_stored": n}
        elif outcome is Delivery.LOST:
            deltas = {"spans_failed_export": n}
        elif outcome is Delivery.FALLBACK:
            deltas = {"spans_spooled": n, "spans_spooled_fallback": n}
        else:
            deltas = {"spans_spooled": n}
        with self._state:
            late = self._final
            if late:
                # Counted as dropped at shutdown, yet the process still lives and the batch arrived after
                # all: correct the counters (published below) so the span is not counted twice.
                if outcome is Delivery.LOST:
                    return
                deltas["spans_dropped_at_shutdown"] = -n
            else:
                self._in_flight -= n
            self.counters.apply(deltas)
            self._state.notify_all()
        if late:
            self._publish(final=True)

    def _publish(self, final: bool = False) -> None:
        with self._publishing:
            if self._final and not final:
                return  # the final counters are out; an older snapshot must not overwrite them
            snapshot = self.counters.snapshot()
            if snapshot == self._published and not final:
                return
            self._published = snapshot
            if self.stats is not None:
                self.stats.publish(snapshot)
            elif final and lost(snapshot):
                # Nowhere to publish (logged when that was found out): the log is the record.
                log.warning("kvtrace: span counters of this process: %s", snapshot)

    # --- lifecycle -------------------------------------------------------------------

    def _wait_idle(self, deadline: float) -> bool:
        with self._state:
            while self._queue or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.set()
                self._state.wait(min(remaining, 0.05))
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        done = self._wait_idle(time.monotonic() + timeout_millis / 1000)
        self._publish()
        return done

    def shutdown(self) -> None:
        """Deliver, spool or count everything within ``shutdown_timeout_s``; never waits longer."""
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + self.shutdown_timeout_s
        has_spool = getattr(self.exporter, "spool_directly", None) is not None
        if not self._wait_idle(deadline - self.shutdown_timeout_s / 2 if has_spool else deadline) and has_spool:
            # The sink is slow or hung: what is still queued goes straight to the spool from here.
            self._spool_only = True
            while self._queue and time.monotonic() < deadline:
                batch = self._take_batch()
                if batch:
                    batch = self._built(batch)
                    self._settle(batch, self._deliver(batch, timeout=max(0.0, deadline - time.monotonic())))
            self._wait_idle(deadline)
        with self._state:
            self._final = True
            stranded = len(self._queue) + self._in_flight
            self._queue.clear()
            self.counters.add("spans_dropped_at_shutdown", stranded)
            worker_idle = self._in_flight == 0
        self._wake.set()
        if stranded:
            log.warning("kvtrace: %d span(s) not delivered within KVTRACE_SHUTDOWN_TIMEOUT (%g ms); counted as "
                        "dropped at shutdown", stranded, self.shutdown_timeout_s * 1000)
        self._publish(final=True)
        if not worker_idle:
            return  # a worker still inside a hung sink keeps its exporter and the counters' file
        try:
            self.exporter.shutdown()
        except Exception:
            log.debug("kvtrace: exporter shutdown failed", exc_info=True)
        if self.stats is not None:
            self.stats.close()
