"""Keep a long-running proxy's heap small and cheap: few malloc arenas, their free memory given back,
and Python's cyclic collector run on the proxy's scale, not a script's.

The proxy's connection and record threads allocate from glibc's per-thread arenas, and what they
free stays there in scattered pages: under steady load the proxy's RSS grew about 1 KB a request
with no more objects alive (docs/findings.md). Its threads share two arenas (they take turns on the
GIL anyway), and glibc's ``malloc_trim(0)`` returns the free pages of every arena. Where the C
library has no such calls (musl, macOS) this does nothing.

A relayed token allocates dozens of short-lived objects that reference counting frees at once; at
Python's default (a young collection every 700 net allocations) the cyclic collector ran every few
tokens and found nothing. It runs every ``YOUNG_COLLECTION_EVERY`` instead, and the objects made at
start-up (modules, settings) are frozen out of every collection.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import time
from typing import Callable, Optional

TRIM_EVERY_S = 60.0
ARENAS = 2
YOUNG_COLLECTION_EVERY = 50_000
"""Net allocations between collections of the youngest generation (Python's default: 700)."""
M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter: the most arenas its malloc makes."""


def _c_function(name: str, argtypes: list) -> Optional[Callable[..., int]]:
    try:
        function = getattr(ctypes.CDLL(None), name)  # the C library this process runs on
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


_MALLOC_TRIM = _c_function("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _c_function("mallopt", [ctypes.c_int, ctypes.c_int])


def limit_arenas(count: int = ARENAS) -> bool:
    """Let threads started from now on share at most ``count`` malloc arenas; whether the C library can."""
    return _MALLOPT is not None and platform.libc_ver()[0] == "glibc" and _MALLOPT(M_ARENA_MAX, count) == 1


def collect_less_often(young: int = YOUNG_COLLECTION_EVERY) -> None:
    """Collect the youngest generation every ``young`` net allocations, and leave what exists now (the
    proxy's start-up) out of every collection. Called once, when the proxy is about to serve."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)


def release_free_memory() -> bool:
    """Return the C heap's free pages to the operating system; whether the C library can."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class PeriodicTrim:
    """:func:`release_free_memory` at most every ``every_s`` seconds, from a loop that calls :meth:`tick`."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self._every_s, self._clock = every_s, clock
        self._next = clock() + every_s

    def tick(self) -> None:
        now = self._clock()
        if now >= self._next:
            self._next = now + self._every_s
            release_free_memory()
