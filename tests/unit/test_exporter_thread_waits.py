"""kvtrace/recording/pipeline.py: an exporter thread with nothing queued waits for the next span, not a
tick. Each wake takes the GIL back from the engine's thread, so a thread that ticked every 100 ms while
idle cost vLLM's engine process CPU for nothing (docs/findings.md); yet a span queued while it waits must
go out at once, not after the long wait."""

from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from kvtrace.recording import pipeline as pipeline_module
from kvtrace.recording.pipeline import SpanPipeline
from gated_sink import GatedExporter

IDLE_WAIT_S = 600.0
"""The counters' interval in these tests: an exporter thread that waited it out would fail them."""


class RecordingEvent(threading.Event):
    """The worker's wake event, keeping each wait's time-out as the wait begins."""

    def __init__(self):
        super().__init__()
        self.timeouts: list[float] = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        return super().wait(timeout)


def until(condition, what: str, limit_s: float = 20.0) -> None:
    """Wait for ``condition`` (a bound on a hang, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.fixture
def pipeline(monkeypatch):
    monkeypatch.setattr(pipeline_module, "STATS_INTERVAL_S", IDLE_WAIT_S)
    exporter = GatedExporter()
    exporter.gate.set()  # open, until a test holds a batch
    pipeline = SpanPipeline(exporter, schedule_delay_ms=20)
    first, pipeline._wake = pipeline._wake, RecordingEvent()
    first.set()  # the worker's first wait ends; every later one is recorded
    yield pipeline, exporter
    pipeline.shutdown()


def test_an_idle_exporter_thread_waits_for_the_next_span_and_a_span_wakes_it_at_once(pipeline):
    pipeline, exporter = pipeline
    wake = pipeline._wake
    until(lambda: IDLE_WAIT_S in wake.timeouts, "the exporter thread never went idle")
    idle_waits = wake.timeouts.count(IDLE_WAIT_S)
    ticks_before = len(wake.timeouts)

    pipeline.on_end(ReadableSpan(name="request"))
    until(lambda: len(exporter.get_finished_spans()) == 1, "a span queued while idle waited for the long wait")

    # Spans came: it ticks again (schedule_delay), and after a tick that finds none it waits idle once more.
    until(lambda: wake.timeouts.count(IDLE_WAIT_S) > idle_waits, "the exporter thread did not go idle again")
    after = wake.timeouts[ticks_before:]
    assert pytest.approx(0.02) in after, after
    assert after[-1] == IDLE_WAIT_S


def test_a_burst_of_spans_costs_the_engines_thread_one_wake(pipeline):
    pipeline, exporter = pipeline
    wake = pipeline._wake
    until(lambda: IDLE_WAIT_S in wake.timeouts, "the exporter thread never went idle")
    sets = []
    original_set = wake.set
    wake.set = lambda: (sets.append(1), original_set())[1]

    exporter.gate.clear()  # the first span's batch is held in the sink while the rest of the burst comes
    for _ in range(50):
        pipeline.on_end(ReadableSpan(name="request"))
    exporter.gate.set()
    until(lambda: len(exporter.get_finished_spans()) == 50, "spans were left queued")
    assert len(sets) == 1  # the first span of the burst woke it; the rest were drained behind it
