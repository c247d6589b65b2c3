"""How the CLI shows an error nobody foresaw: one line, or the traceback on request.

Foreseen mistakes are ``KvtraceError`` subclasses (``kvtrace/errors.py``)
with messages that say what to do; anything else still gets one line on
stderr.  ``--debug`` or ``KVTRACE_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import os


def one_line(exc: BaseException) -> str:
    """An unexpected exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def traceback_requested(args=None) -> bool:
    """``--debug`` or ``KVTRACE_DEBUG=1``: show tracebacks instead of one-line errors."""
    return bool(getattr(args, "debug", False)) or os.environ.get("KVTRACE_DEBUG", "").lower() in ("1", "true", "yes")
