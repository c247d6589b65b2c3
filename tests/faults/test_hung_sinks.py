"""A sink that hangs or refuses: the host exits in bounded time and every span is stored, spooled or counted.

Each test runs a real host process that records spans through the real
recorder and exits, against a real TCP server on 127.0.0.1 that accepts
connections and never answers (a black hole) or against a port that refuses.
The counters are read as ``kvtrace db status`` reads them, and the spool is
ingested into the embedded ClickHouse to count what it really holds.
"""

from __future__ import annotations

import pytest
from sink_faults import (BlackHole, Collector, assert_every_span_accounted, counters_of, record_spans,
                         refused_port, sink_env, spooled_spans)


@pytest.fixture
def black_hole():
    server = BlackHole()
    yield server
    server.close()


@pytest.mark.parametrize("exporter", ["clickhouse", "otlp"])
@pytest.mark.parametrize("sink", ["black hole", "refused port"])
def test_a_dead_or_hung_sink_sends_every_span_to_the_spool(exporter, sink, request, spool_dir, db):
    port = request.getfixturevalue("black_hole").port if sink == "black hole" else refused_port()
    # A generous shutdown time, so that on a busy machine too nothing has to be cut off at exit.
    env = {**sink_env(exporter, port), "KVTRACE_RUN_ID": "hung-sink", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50",
           "KVTRACE_SHUTDOWN_TIMEOUT": "20000"}
    host = record_spans(500, env)
    print(f"{exporter} / {sink}: the host exited after {host.seconds:.2f} s")

    counters = counters_of(spool_dir)
    assert_every_span_accounted(500, counters, stored=0, spooled=spooled_spans(db, spool_dir, "hung-sink"))
    assert counters["spans_spooled_fallback"] == 500  # the queue held them all: nothing was lost
    # Ten batches, one warning: the sink is left alone for a while after it failed.
    assert len(host.warnings("failed (")) == 1, host.stderr
    if sink == "black hole":
        assert request.getfixturevalue("black_hole").accepted >= 1  # the sink was really tried


def test_a_collector_that_answers_stores_every_span(spool_dir, db):
    collector = Collector()
    try:
        env = {**sink_env("otlp", collector.port), "KVTRACE_RUN_ID": "healthy", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50",
               "KVTRACE_SHUTDOWN_TIMEOUT": "20000"}
        host = record_spans(500, env)
    finally:
        collector.close()
    counters = counters_of(spool_dir)
    assert_every_span_accounted(500, counters, stored=collector.spans, spooled=spooled_spans(db, spool_dir, "healthy"))
    assert collector.spans == 500 and not host.warnings("kvtrace")


def test_the_spool_exporter_accounts_for_every_span(spool_dir, db):
    host = record_spans(500, {"KVTRACE_RUN_ID": "spool-only", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50"})
    counters = counters_of(spool_dir)
    assert_every_span_accounted(500, counters, stored=0, spooled=spooled_spans(db, spool_dir, "spool-only"))
    assert counters["spans_spooled_fallback"] == 0 and not host.warnings("kvtrace")


def test_more_spans_than_the_queue_holds_behind_a_hung_clickhouse_are_spooled_or_counted(black_hole, spool_dir,
                                                                                      db):
    # The case that lost 2,339 of 3,000 spans silently: a queue of 2048 behind a server that never answers.
    env = {**sink_env("clickhouse", black_hole.port), "KVTRACE_RUN_ID": "overflow"}
    record_spans(3000, env)
    counters = counters_of(spool_dir)
    assert_every_span_accounted(3000, counters, stored=0, spooled=spooled_spans(db, spool_dir, "overflow"))
    print({k: v for k, v in counters.items() if v})


@pytest.mark.parametrize("exporter", ["clickhouse", "otlp"])
def test_a_sink_that_outlasts_the_shutdown_time_is_cut_off_and_what_it_held_is_counted(exporter, black_hole,
                                                                                     spool_dir, db):
    # Time-outs far longer than the shutdown allows: the first batch is stuck in the black hole for a minute.
    env = {**sink_env(exporter, black_hole.port), "KVTRACE_RUN_ID": "cut-off", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50",
           "KVTRACE_CONNECT_TIMEOUT": "60000", "OTEL_BSP_EXPORT_TIMEOUT": "60000", "OTEL_EXPORTER_OTLP_TIMEOUT": "60000",
           "KVTRACE_SHUTDOWN_TIMEOUT": "3000"}
    host = record_spans(200, env)
    print(f"{exporter}: the host exited after {host.seconds:.2f} s with a 3 s shutdown time")

    counters = counters_of(spool_dir)
    assert_every_span_accounted(200, counters, stored=0, spooled=spooled_spans(db, spool_dir, "cut-off"))
    assert counters["spans_dropped_at_shutdown"] >= 1  # the batch in the sink's hands, counted
    assert counters["spans_spooled"] >= 1  # the rest went straight to the spool
    assert host.warnings("dropped at shutdown"), host.stderr
