"""kvtrace: OpenTelemetry tracing inside LLM inference engines that says why two runs forked."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

from kvtrace import semconv
from kvtrace.config import ENABLED_VARIABLE
try:
    from kvtrace.patches import patch_all, unpatch_all  # only the registry: a patch loads when its engine is imported
except ModuleNotFoundError as missing:
    if missing.name != "kvtrace.patches":
        raise
    # A repository's kvtrace/ folder has no patches/ (an install maps the top-level one in): this is
    # the clone itself, put first on sys.path by `python -m` or a script run from the clone's root.
    raise ImportError(f"kvtrace was imported from the source folder {__path__[0]}, not from an install: "
                      "run Python from another folder (or use the venv's `kvtrace`/`pytest` scripts), "
                      "or install the clone with `pip install -e .`", name=__name__) from None

__version__ = "0.1.0"

__all__ = ["__version__", "instrument", "uninstrument", "correlate"]


def instrument(engines: Optional[list[str]] = None) -> list[str]:
    """Patch the supported engines (now, or lazily when they are imported).

    Also opts this process and those it starts in to recording (``KVTRACE_ENABLED=1``), so that an
    engine process it spawns (vLLM's engine core, its workers) records through kvtrace's plugin too.
    Returns the names of the engines whose patches were registered.
    """
    os.environ[ENABLED_VARIABLE] = "1"
    return patch_all(engines)


def uninstrument() -> None:
    unpatch_all()


@contextlib.contextmanager
def correlate(run_id: Optional[str] = None, episode_id: Optional[str] = None,
              turn: Optional[int] = None, arm: Optional[str] = None) -> Iterator[None]:
    """Tag the requests made inside the block with run / episode / turn.

    Uses W3C baggage, exactly as a client harness would through HTTP headers,
    so in-process and server-side tagging go through one path.
    """
    # Deferred: `kvtrace run` imports kvtrace in every Python process at start-up, and OpenTelemetry
    # picks its context implementation when first imported; that stays the host's to configure.
    from opentelemetry import baggage, context

    ctx = context.get_current()
    for key, value in ((semconv.RUN_ID, run_id), (semconv.EPISODE_ID, episode_id), (semconv.TURN, turn),
                       (semconv.ARM, arm)):
        if value is not None:
            ctx = baggage.set_baggage(key, str(value), ctx)
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)
