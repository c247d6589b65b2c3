"""Engine patches: one module per engine, all with the same face.

Every engine module defines ``ENGINE`` (its name), ``MODULE`` (the import
that triggers it), ``get_version()``, ``supported_versions()``, ``patch()``
and ``unpatch()``; ``patch()`` is idempotent.  This registry applies them
lazily with ``wrapt.importer.when_imported`` so a library imported later — or
in a subprocess that runs ``kvtrace run`` — is still patched.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

log = logging.getLogger("kvtrace")

# engine name -> (module that holds its patch, module whose import triggers it)
ENGINES: dict[str, tuple[str, str]] = {
    "llama_cpp": ("kvtrace.patches.llama_cpp", "llama_cpp"),
    "vllm": ("kvtrace.patches.vllm", "vllm"),
}

_registered: set[str] = set()


def supported_requirements() -> tuple[str, ...]:
    """Each engine distribution with the versions its patch supports (``"vllm>=0.32,<0.35"``).

    The patch modules own their ranges (``supported_versions()``); the
    OpenTelemetry instrumentor and the packaging test read them from here.
    Importing a patch module does not import its engine.
    """
    return tuple(f"{distribution}{specifier}"
                 for module, _ in ENGINES.values()
                 for distribution, specifier in importlib.import_module(module).supported_versions().items())


def _apply(engine: str) -> None:
    try:
        importlib.import_module(ENGINES[engine][0]).patch()
    except Exception as exc:  # an unsupported engine must never crash the host
        log.warning("kvtrace: %s not instrumented: %s", engine, exc)


def patch_all(engines: Optional[list[str]] = None) -> list[str]:
    import wrapt

    chosen = list(ENGINES) if not engines else engines
    for engine in chosen:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
        if engine in _registered:
            continue
        _registered.add(engine)
        trigger = ENGINES[engine][1]
        wrapt.importer.when_imported(trigger)(lambda _module, engine=engine: _apply(engine))
    return chosen


def unpatch_all() -> None:
    for engine in list(_registered):
        try:
            module = importlib.import_module(ENGINES[engine][0])
        except ImportError:
            continue
        module.unpatch()
