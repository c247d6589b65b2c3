"""``python -m llama_cpp.server``: each HTTP request's W3C trace context becomes the current context.

``llama_cpp.server.app.create_app`` is wrapped to add :class:`~kvtrace.patches.hooks.TraceContextMiddleware`
to the app it returns, so a caller's ``traceparent`` / ``baggage`` (run id, episode, turn) reach the
record of the engine call that serves the request.
"""

from __future__ import annotations

from typing import Any

from kvtrace.patches.hooks import add_trace_context_middleware, observing
from kvtrace.patches.llama_cpp.engine import FAILURES

SERVER_MODULE = "llama_cpp.server.app"


def _add_middleware(app: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    add_trace_context_middleware(app, FAILURES)


create_app_wrapper = observing(FAILURES, "server create_app", _add_middleware)
