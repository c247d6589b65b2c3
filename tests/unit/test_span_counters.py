"""kvtrace/recording/counters.py: threads that count together lose nothing, and a snapshot is one moment.

The engine, exporter and proxy threads all count into one process's counters, and
``spans_finished = spans_stored + spans_spooled + lost`` holds only if no update is lost and no
reader sees half of one. The interpreter is made to switch threads as often as it can, so that a
counter without its lock would lose updates or show a pair half-changed here.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from kvtrace.recording.counters import SpanCounters
from kvtrace.recording.pipeline import SpanPipeline
from kvtrace.recording.stats import COUNTERS, lost
from gated_sink import GatedExporter


@pytest.fixture
def eager_thread_switches():
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def run_together(workers, watch) -> list[dict[str, int]]:
    """Start ``workers`` (callables), snapshot with ``watch`` until they are done; the snapshots taken."""
    threads = [threading.Thread(target=work) for work in workers]
    snapshots = []
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        snapshots.append(watch())
        time.sleep(0.0005)  # room for the counting threads (a spinning reader would starve them)
    for thread in threads:
        thread.join()
    return snapshots


def test_eight_threads_counting_a_pair_end_with_exact_totals_and_no_snapshot_shows_half_a_pair(
        eager_thread_switches):
    counters = SpanCounters()
    pair = {"spans_finished": 1, "spans_queued": 1}

    def count() -> None:
        for _ in range(50_000):
            counters.apply(pair)
            counters.add("instrumentation_errors")

    snapshots = run_together([count] * 8, counters.snapshot)

    assert counters.snapshot() == {**dict.fromkeys(COUNTERS, 0), "spans_finished": 400_000,
                                   "spans_queued": 400_000, "instrumentation_errors": 400_000}
    assert len(snapshots) > 1  # taken while the threads ran, not only before or after
    for before, after in zip(snapshots, snapshots[1:]):
        assert after["spans_finished"] >= before["spans_finished"]
    assert all(s["spans_finished"] == s["spans_queued"] for s in snapshots), "a snapshot split a pair"


def test_a_change_with_an_unknown_name_changes_nothing():
    counters = SpanCounters()
    with pytest.raises(KeyError, match="spans_misspelt"):
        counters.apply({"spans_finished": 1, "spans_misspelt": 1})
    with pytest.raises(KeyError):
        counters.add("spans_misspelt")
    assert counters.snapshot() == dict.fromkeys(COUNTERS, 0)


def test_spans_ended_on_many_threads_are_each_counted_once_while_the_exporter_thread_settles_them():
    exporter = GatedExporter()
    pipeline = SpanPipeline(exporter, max_queue_size=64, max_batch_size=16, schedule_delay_ms=1)

    span = ReadableSpan(name="request")  # one span ended again and again: making one costs far more

    def end_spans() -> None:
        for i in range(20_000):
            pipeline.on_end(span)
            if i == 10_000:  # by now the queue has overflowed behind the held first batch
                exporter.gate.set()

    snapshots = run_together([end_spans] * 4, pipeline.counters.snapshot)
    pipeline.shutdown()
    totals = pipeline.counters.snapshot()

    assert len(snapshots) > 1
    for s in snapshots:  # while running: each end counted with where it went; nothing settled unqueued
        assert s["spans_finished"] == s["spans_queued"] + s["spans_dropped_queue_full"]
        assert s["spans_stored"] + s["spans_failed_export"] <= s["spans_queued"]
    assert totals["spans_finished"] == 80_000
    assert totals["spans_stored"] == len(exporter.get_finished_spans())
    assert totals["spans_dropped_queue_full"] >= 10_000 - 64 - 16  # the drop path ran too
    assert totals["spans_finished"] == totals["spans_stored"] + totals["spans_spooled"] + lost(totals)
