"""The API process: what it adds so the engine core can correlate a request.

The API process records nothing itself.  ``InputProcessor.process_inputs`` puts the caller's W3C
trace context, its baggage (run / episode / turn) and the external request id into
``EngineCoreRequest.trace_headers``, a field vLLM already ships to the engine core, which reads
them at admission.  Both ends are kvtrace, so the baggage travels as JSON (:data:`BAGGAGE_HEADER`):
the W3C baggage propagator's validation was about half of the admission hook's time.  The OpenAI
server's ``build_app`` gets a middleware that makes each HTTP request's ``traceparent`` / ``baggage``
current, so the caller's context reaches ``process_inputs``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from opentelemetry import baggage
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtrace.patches.hooks import add_trace_context_middleware, observing
from kvtrace.patches.vllm.common import FAILURES, arg

REQUEST_ID_HEADER = "kvtrace-request-id"
"""Trace header carrying the external request id from the API process to the engine core."""

BAGGAGE_HEADER = "kvtrace-baggage"
"""Trace header carrying the caller's baggage entries as a JSON object."""

TRACE_CONTEXT = TraceContextTextMapPropagator()
"""W3C trace context, whatever ``OTEL_PROPAGATORS`` says: both ends are kvtrace."""

PROPAGATOR = CompositePropagator([TRACE_CONTEXT, W3CBaggagePropagator()])
"""W3C trace context and baggage: for trace headers that came from elsewhere (vLLM's own)."""


def _inject_trace_headers(request: Any, processor: Any, args: tuple, kwargs: dict) -> None:
    """``InputProcessor.process_inputs(request_id, ...)`` returned ``request`` (an EngineCoreRequest)."""
    headers = dict(getattr(request, "trace_headers", None) or {})
    carrier: dict[str, str] = {}
    TRACE_CONTEXT.inject(carrier)
    entries = baggage.get_all()
    if entries:
        carrier[BAGGAGE_HEADER] = _baggage_text(entries)
    for key, value in carrier.items():
        headers.setdefault(key, value)
    headers.setdefault(REQUEST_ID_HEADER, str(arg(args, kwargs, 0, "request_id")))
    request.trace_headers = headers


_last_baggage: tuple[tuple, str] = ((), "")
"""The last baggage entries written and their text: a batch's requests carry the same baggage."""


def _baggage_text(entries: Any) -> str:
    global _last_baggage
    items = tuple(entries.items())
    if items != _last_baggage[0]:
        _last_baggage = (items, json.dumps(dict(items), default=str))
    return _last_baggage[1]


process_inputs = observing(FAILURES, "process_inputs", _inject_trace_headers)


def build_app(patched: Callable[[], bool]) -> Callable:
    """The ``build_app`` wrapper.  ``patched()`` says whether kvtrace is still on: a module that
    imported ``build_app`` by name keeps calling this wrapper after ``unpatch()``."""

    def add_middleware(app: Any, instance: Any, args: tuple, kwargs: dict) -> None:
        if not patched():
            return
        # vLLM 0.32's build_app ends with the SageMaker bootstrap, which may already build the
        # middleware stack; Starlette then refuses add_middleware.  Drop the built stack, add
        # ours, and rebuild it as it was (Starlette would otherwise rebuild it on first call).
        built = getattr(app, "middleware_stack", None) is not None
        if built and not getattr(app, "_kvtrace_middleware", False):
            app.middleware_stack = None
        add_trace_context_middleware(app, FAILURES)
        if built and app.middleware_stack is None:
            app.middleware_stack = app.build_middleware_stack()

    return observing(FAILURES, "server build_app", add_middleware)
