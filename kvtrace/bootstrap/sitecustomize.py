"""Loaded by Python at start-up when ``kvtrace run`` puts this directory first on PYTHONPATH.

It first runs whatever ``sitecustomize`` the environment would have loaded
without kvtrace (so wrapping a command never removes the host's own start-up
hooks), then registers kvtrace's lazy engine patches.  Failures are reported
on stderr and never stop the wrapped program.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain_previous_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _instrument() -> None:
    import kvtrace  # here, inside the guard below: a kvtrace that fails to import must not stop the host

    engines = [e for e in os.environ.get("KVTRACE_ENGINES", "").split(",") if e.strip()]
    kvtrace.instrument([e.strip() for e in engines] or None)


try:
    _chain_previous_sitecustomize()
except Exception as exc:  # the host's own hook failing is reported, as Python would
    print(f"kvtrace: the previous sitecustomize failed: {exc!r}", file=sys.stderr)

try:
    _instrument()
except Exception as exc:
    print(f"kvtrace: instrumentation not installed: {exc!r}", file=sys.stderr)
