"""``KvtraceInstrumentor``: kvtrace as an OpenTelemetry instrumentor.

Registered under the ``opentelemetry_instrumentor`` entry point, so
``opentelemetry-instrument python app.py`` patches the engines with no code
change.  kvtrace covers several engines and a process normally has only one
of them, so its dependency check is "any of": the manual path
(``KvtraceInstrumentor().instrument()``) refuses only when no supported engine
is installed.  (``opentelemetry-instrument`` itself does not call this check;
it reads the distribution's ``instruments`` / ``instruments-any`` extras and
then instruments with ``skip_dep_check=True``.)  Patching is lazy either way:
an engine imported later is patched on import.
"""

from __future__ import annotations

from typing import Any, Collection, Optional

from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

import kvtrace
from kvtrace.patches import supported_requirements


class KvtraceInstrumentor(BaseInstrumentor):
    """Instruments every supported engine (``engines=[...]`` narrows the choice)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return supported_requirements()

    def _check_dependency_conflicts(self) -> Optional[DependencyConflict]:
        return get_dependency_conflicts([], self.instrumentation_dependencies())

    def _instrument(self, **kwargs: Any) -> None:
        kvtrace.instrument(kwargs.get("engines"))

    def _uninstrument(self, **kwargs: Any) -> None:
        kvtrace.uninstrument()
