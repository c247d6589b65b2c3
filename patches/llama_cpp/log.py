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


class LogRoute:
    """llama.cpp's log callback, switched to :attr:`on_message` by the outermost block and back by its exit."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: llama.cpp may log while the route is being switched
        self._depth = 0
        self._previous: Optional[tuple[Any, Any]] = None
        self._partial: list[str] = []  # llama.cpp writes one line in several calls (the quantizer does)
        self._callback: Any = None  # the ctypes callback object must outlive every call llama.cpp makes to it

    def on_message(self, level: int, text: bytes, user_data: Any) -> None:
        try:
            chunk = text.decode("utf-8", errors="replace") if text else ""
            with self._lock:
                self._partial.append(chunk)
                if "\n" not in chunk:
                    return
                lines = "".join(self._partial).split("\n")
                self._partial[:] = [lines.pop()]
            for line in lines:
                if line.strip():
                    log.debug("%s", line.rstrip())
        except Exception:
            pass  # a log line must never raise into llama.cpp

    def enter(self, llama_cpp: Any) -> None:
        with self._lock:
            if self._depth == 0:
                try:
                    self._previous = _current_callback(llama_cpp)
                    if self._callback is None:
                        self._callback = llama_cpp.llama_log_callback(self.on_message)
                    llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))
                except Exception:
                    log.debug("cannot route llama.cpp's log", exc_info=True)
            self._depth += 1

    def exit(self, llama_cpp: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth > 0:
                return
            if self._partial and self._partial[0].strip():
                log.debug("%s", self._partial[0].rstrip())
            self._partial.clear()
            if self._previous is not None:
                try:
                    llama_cpp.llama_log_set(*self._previous)
                except Exception:
                    log.debug("cannot restore llama.cpp's log callback", exc_info=True)
            self._previous = None


ROUTE = LogRoute()


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
    try:
        import llama_cpp  # optional heavy engine import: kvtrace runs without llama-cpp-python
    except ImportError:
        yield
        return
    ROUTE.enter(llama_cpp)
    try:
        yield
    finally:
        ROUTE.exit(llama_cpp)
