"""llama.cpp's own log lines, while kvtrace itself drives llama.cpp: into Python logging at DEBUG.

llama-cpp-python installs a log callback that prints llama.cpp's messages to stderr; before the
first ``Llama`` of a process sets its level it prints all of them (the quantizer's per-tensor
``[   1/  21] ...`` lines, ``llama_model_loader: ...``), and afterwards warnings such as the
``n_ctx_train`` one.  kvtrace's own commands (demo, experiment, make-model) must print only their
own output, so around kvtrace's own quantize and load calls :func:`llama_log_to_logging` routes
the messages, whole lines at a time, to the ``kvtrace.llama_cpp`` logger at DEBUG (``kvtrace -v``
shows them) and puts the previous callback back afterwards.  ``llama_log_set`` also sets ggml's
logger, so ggml's lines (backend loading, the quantizer's fallback warnings) come along.

The callback is process-wide while the block runs: only kvtrace's own code enters it, never the
instrumentation of a user's engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any, Optional

log = logging.getLogger("kvtrace.llama_cpp")

_lock = threading.RLock()  # re-entrant: llama.cpp may log while the route is being switched
_depth = 0
_previous: Optional[tuple[Any, Any]] = None
_partial: list[str] = []  # llama.cpp writes one line in several calls (the quantizer does)
_callback: Any = None  # the ctypes callback object must outlive every call llama.cpp makes to it


def _on_message(level: int, text: bytes, user_data: Any) -> None:
    try:
        chunk = text.decode("utf-8", errors="replace") if text else ""
        with _lock:
            _partial.append(chunk)
            if "\n" not in chunk:
                return
            lines = "".join(_partial).split("\n")
            _partial[:] = [lines.pop()]
        for line in lines:
            if line.strip():
                log.debug("%s", line.rstrip())
    except Exception:
        pass  # a log line must never raise into llama.cpp


def _current_callback(llama_cpp: Any) -> Optional[tuple[Any, Any]]:
    """The callback in force now, to put back afterwards; ``None`` when this version cannot tell."""
    if hasattr(llama_cpp, "llama_log_get"):
        callback, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
        llama_cpp.llama_log_get(ctypes.byref(callback), ctypes.byref(user_data))
        return callback, user_data
    own = getattr(getattr(llama_cpp, "_logger", None), "llama_log_callback", None)
    return (own, ctypes.c_void_p(0)) if own is not None else None


@contextlib.contextmanager
def llama_log_to_logging() -> Iterator[None]:
    """Route llama.cpp's (and ggml's) log to ``logging.getLogger("kvtrace.llama_cpp")`` at DEBUG.

    Nestable and thread-safe: the outermost block installs the route, the outermost exit restores
    what was there.  Without llama-cpp-python it does nothing.
    """
    global _depth, _previous, _callback
    try:
        import llama_cpp
    except ImportError:
        yield
        return
    with _lock:
        if _depth == 0:
            try:
                _previous = _current_callback(llama_cpp)
                if _callback is None:
                    _callback = llama_cpp.llama_log_callback(_on_message)
                llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
            except Exception:
                log.debug("cannot route llama.cpp's log", exc_info=True)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _partial and _partial[0].strip():
                    log.debug("%s", _partial[0].rstrip())
                _partial.clear()
                if _previous is not None:
                    try:
                        llama_cpp.llama_log_set(*_previous)
                    except Exception:
                        log.debug("cannot restore llama.cpp's log callback", exc_info=True)
                _previous = None
