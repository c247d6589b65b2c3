"""Which engine this package instruments, and where its hooks count their failures.

Kept apart from the package's ``__init__`` so every hook module can name the engine without
importing the hook table that lists them.
"""

from __future__ import annotations

from kvtrace.patches.hooks import EngineVersion, HookFailures

ENGINE = "llama_cpp"
MODULE = "llama_cpp"
VERSION = EngineVersion(engine=ENGINE, distributions=("llama-cpp-python",), specifier=">=0.3.30,<0.4",
                        module=MODULE)
FAILURES = HookFailures(ENGINE)
"""Every hook of this package counts (and logs once) the failures it catches here."""
