"""What every engine patch shares.

* :class:`HookFailures` — a hook that fails is counted on the recorder and
  logged once per hook, never raised into the engine;
* :func:`version_supported` — the version gate of ``patch()``;
* :class:`Wrappings` — the attributes a patch replaced, so ``unpatch()`` puts
  every original back;
* :class:`TraceContextMiddleware` — for an engine's HTTP server: the request's
  W3C ``traceparent`` / ``baggage`` become the current context.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from kvtrace.recorder import Recorder, get_recorder

log = logging.getLogger("kvtrace")


class HookFailures:
    """Counts (and logs once per hook) instrumentation failures of one engine's patch."""

    def __init__(self, engine: str):
        self.engine = engine
        self._warned: set[str] = set()

    def count(self, where: str, recorder: Optional[Recorder] = None) -> None:
        """Call from an ``except`` block; never raises."""
        try:
            recorder = recorder or get_recorder()
            if recorder is not None:
                recorder.pipeline.counters["instrumentation_errors"] += 1
            level = logging.DEBUG if where in self._warned else logging.WARNING
            self._warned.add(where)
            log.log(level, "kvtrace: %s instrumentation error in %s (counted; engine unaffected)", self.engine,
                    where, exc_info=True)
        except Exception:
            pass


def version_supported(version: str, specifier: str) -> bool:
    """Whether ``version`` satisfies ``specifier`` (pre-releases of a supported series included)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


class Wrappings:
    """The attributes an engine patch replaced with wrapt wrappers."""

    def __init__(self) -> None:
        self._replaced: list[tuple[Any, str]] = []

    def __contains__(self, owner_and_name: tuple[Any, str]) -> bool:
        return owner_and_name in self._replaced

    def wrap(self, target: Any, path: str, wrapper: Callable) -> None:
        """``wrapt.wrap_function_wrapper(target, path, wrapper)``, remembered for :meth:`restore_all`.

        ``path`` is an attribute of ``target`` or ``"Class.attribute"`` of a module.
        """
        import wrapt

        owner_name, _, name = path.rpartition(".")
        owner = getattr(target, owner_name) if owner_name else target
        wrapt.wrap_function_wrapper(target, path, wrapper)
        self._replaced.append((owner, name))

    def restore_all(self) -> None:
        """Put every original back (newest first).  Idempotent."""
        while self._replaced:
            owner, name = self._replaced.pop()
            current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            original = getattr(current, "__wrapped__", None)
            if original is not None:
                setattr(owner, name, original)


class TraceContextMiddleware:
    """ASGI middleware: the request's ``traceparent`` and ``baggage`` become the current context.

    Uses the global propagator (W3C tracecontext + baggage unless
    ``OTEL_PROPAGATORS`` says otherwise).  Work the app hands to threads
    (``run_in_threadpool`` / ``iterate_in_threadpool``) copies the context, so
    the engine call sees it — including every step of a stream.
    """

    def __init__(self, app: Any, failures: Optional[HookFailures] = None):
        self.app = app
        self.failures = failures or HookFailures("server")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        try:
            from opentelemetry import context, propagate

            carrier: dict[str, str] = {}
            for name, value in scope.get("headers") or ():
                key = name.decode("latin-1").lower()
                text = value.decode("latin-1")
                carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
            token = context.attach(propagate.extract(carrier))
        except Exception:
            self.failures.count("server trace context")
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            context.detach(token)


def add_trace_context_middleware(app: Any, failures: HookFailures) -> None:
    """Install :class:`TraceContextMiddleware` on a Starlette/FastAPI ``app`` once."""
    if not getattr(app, "_kvtrace_middleware", False):
        app.add_middleware(TraceContextMiddleware, failures=failures)
        app._kvtrace_middleware = True
