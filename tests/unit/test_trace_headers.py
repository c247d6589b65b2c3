"""The headers a record sends with its request are OpenTelemetry's propagators' own output."""

from __future__ import annotations

import pytest
from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtrace import semconv as sc
from kvtrace.exchanges.recorder import correlation_headers, trace_headers
from kvtrace.recording.records import Correlation, RequestRecord


def _propagated(record: RequestRecord, arm) -> dict[str, str]:
    """What the propagators write for the record: the reference."""
    context = None
    c = record.correlation
    for key, value in ((sc.RUN_ID, c.run_id), (sc.EPISODE_ID, c.episode_id), (sc.TURN, c.turn), (sc.ARM, arm)):
        if value is not None and value != "":
            context = baggage.set_baggage(key, str(value), context)
    carrier: dict[str, str] = {}
    W3CBaggagePropagator().inject(carrier, context=context)
    span = NonRecordingSpan(SpanContext(int(record.trace_id, 16), int(record.span_id, 16), is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier


@pytest.mark.parametrize("run, episode, turn, arm", [
    ("run-1", "", -1, None),
    ("run 1", "ep/1", 0, "cache-on"),
    ("ümlaut,=;%", "e p", 7, "a=b"),
    ("r", "e", 3, 5),  # an arm that is not text
])
def test_headers_are_the_propagators(run, episode, turn, arm):
    record = RequestRecord(correlation=Correlation(run_id=run, episode_id=episode, turn=turn), engine="llama-server",
                           operation=sc.OPERATION_TEXT_COMPLETION, model="m", start_time_unix_nano=1,
                           span_id="00f067aa0ba902b7", trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    if arm is not None:
        record.config[sc.ARM] = arm
    for _ in range(2):  # the second time from the cache
        assert trace_headers(record) == _propagated(record, arm)
        assert trace_headers(record, arm="shadow") == _propagated(record, "shadow")
    assert correlation_headers(run, episode, turn, arm) == {
        k: v for k, v in _propagated(record, arm).items() if k == "baggage"}


def test_ids_of_zeros_as_the_propagator_writes_them():
    record = RequestRecord(correlation=Correlation(run_id="r"), engine="e", operation=sc.OPERATION_TEXT_COMPLETION,
                           model="m", start_time_unix_nano=1, span_id="0" * 16, trace_id="0" * 32)
    assert trace_headers(record) == _propagated(record, None)


def test_a_returned_dict_is_the_callers_own():
    record = RequestRecord(correlation=Correlation(run_id="r"), engine="e", operation=sc.OPERATION_TEXT_COMPLETION,
                           model="m", start_time_unix_nano=1, span_id="00f067aa0ba902b7",
                           trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    trace_headers(record)["baggage"] = "changed"
    correlation_headers("r")["baggage"] = "changed"
    assert trace_headers(record) == _propagated(record, None)
