"""The proxy extracts a client's trace context only when a header the global propagator reads is there."""

from __future__ import annotations

from opentelemetry import propagate
from opentelemetry.propagators.textmap import TextMapPropagator

from kvtrace.proxy.app import _carries_context


class _B3Like(TextMapPropagator):
    """A propagator configured instead of the default (``OTEL_PROPAGATORS``), reading headers of its own."""

    def extract(self, carrier, context=None, getter=None):
        return context

    def inject(self, carrier, context=None, setter=None):
        pass

    @property
    def fields(self):
        return {"X-B3-TraceId", "X-B3-SpanId"}


def test_the_default_propagators_headers():
    assert _carries_context([(b"content-type", b"application/json"), (b"traceparent", b"00-ab-cd-01")])
    assert _carries_context([(b"baggage", b"kvtrace.run_id=r")])
    assert _carries_context([(b"tracestate", b"a=b")])
    assert not _carries_context([(b"content-type", b"application/json"), (b"host", b"proxy")])
    assert not _carries_context([])


def test_a_propagator_configured_instead_is_asked_which_headers_it_reads():
    default = propagate.get_global_textmap()
    propagate.set_global_textmap(_B3Like())
    try:
        assert _carries_context([(b"x-b3-traceid", b"463ac35c9f6413ad")])
        assert not _carries_context([(b"traceparent", b"00-ab-cd-01")])
    finally:
        propagate.set_global_textmap(default)
    assert _carries_context([(b"traceparent", b"00-ab-cd-01")])
