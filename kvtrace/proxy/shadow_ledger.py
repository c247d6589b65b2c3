"""The shadow budget's running state, one for a whole proxy: its worker processes share it
(``kvtrace proxy --workers N``), so the budget holds for the proxy, not N times over.

Counts live in shared memory under one lock (a POSIX semaphore), taken a few times per traced request
while shadowing and never while waiting on anything. ``time.monotonic`` is the system's
``CLOCK_MONOTONIC``, the same in every process, so the token bucket refills alike in all of them.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Optional

from kvtrace.proxy.limits import ShadowBudget

_LEVEL, _AT = 0, 1  # the token bucket: tokens left, when last refilled
_TWINS, _UPSTREAM, _SENT = 0, 1, 2  # twins in flight; traced requests upstream now; sent so far


class ShadowLedger:
    def __init__(self, budget: ShadowBudget, context: Optional[Any] = None):
        context = context or multiprocessing.get_context("spawn")
        self._capacity = float(budget.tokens_per_minute)
        self._twins_at_once = budget.in_flight
        self._lock = context.Lock()
        self._bucket = context.RawArray("d", [self._capacity, time.monotonic()])
        self._counts = context.RawArray("q", 3)

    # --- the minute's tokens ---
    def take_tokens(self, n: int) -> bool:
        with self._lock:
            now = time.monotonic()
            level = min(self._capacity, self._bucket[_LEVEL] + (now - self._bucket[_AT]) * self._capacity / 60.0)
            self._bucket[_AT] = now
            if n > level:
                self._bucket[_LEVEL] = level
                return False
            self._bucket[_LEVEL] = level - n
            return True

    def refund_tokens(self, n: int) -> None:
        with self._lock:
            self._bucket[_LEVEL] = min(self._capacity, self._bucket[_LEVEL] + n)

    # --- twins upstream at once ---
    def take_twin(self) -> bool:
        with self._lock:
            if self._counts[_TWINS] >= self._twins_at_once:
                return False
            self._counts[_TWINS] += 1
            return True

    def twin_done(self) -> None:
        with self._lock:
            self._counts[_TWINS] -= 1

    # --- the proxy's traced requests upstream ---
    def request_sent(self) -> None:
        with self._lock:
            self._counts[_UPSTREAM] += 1
            self._counts[_SENT] += 1

    def request_back(self) -> None:
        with self._lock:
            self._counts[_UPSTREAM] -= 1

    def upstream(self) -> int:
        """Traced requests upstream now, through every worker."""
        return self._counts[_UPSTREAM]

    def sent(self) -> int:
        """Traced requests sent upstream so far, through every worker."""
        return self._counts[_SENT]
