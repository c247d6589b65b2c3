"""Give the free memory of a long-running proxy back to the operating system.

The proxy's connection and record threads allocate from glibc's per-thread arenas, and what they
free stays there in scattered pages: under steady load the proxy's RSS grew about 1 KB a request
with no more objects alive (docs/findings.md). glibc's ``malloc_trim(0)`` returns the free pages of
every arena. Where the C library has no such call (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, Optional

TRIM_EVERY_S = 60.0


def _load_malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


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
