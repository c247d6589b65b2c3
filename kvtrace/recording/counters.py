"""One process's span counters in memory: the one object every thread that counts goes through.

The engine thread (a span ends, a hook fails), the exporter thread (a batch
settles, a value is repaired) and the proxy's connection threads all count
into the same numbers, and ``spans_finished = spans_stored + spans_spooled +
lost`` (``kvtrace/recording/stats.py``) rests on none of those updates being
lost. So every change goes through :meth:`SpanCounters.add` or
:meth:`SpanCounters.apply` under one lock, and readers that need more than one
counter take :meth:`SpanCounters.snapshot`: the changes of one ``apply`` are
in a snapshot all together or not at all.

The lock is held only for a few dictionary updates and is taken once per
call, so a span's end costs the engine thread one uncontended acquire.
"""

from __future__ import annotations

import threading
from typing import Mapping

from kvtrace.recording.stats import COUNTERS


class SpanCounters:
    """The counters named in ``stats.COUNTERS``, all starting at zero; an unknown name is a ``KeyError``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        """``n`` more of counter ``name`` (``n`` may be negative: a correction)."""
        with self._lock:
            self._values[name] += n

    def apply(self, deltas: Mapping[str, int]) -> None:
        """Every change of ``deltas`` at once (a snapshot sees all of them or none); nothing changes on a ``KeyError``."""
        if not deltas.keys() <= self._values.keys():  # the names never change: no lock needed to check
            raise KeyError(", ".join(sorted(deltas.keys() - self._values.keys())))
        with self._lock:
            for name, n in deltas.items():
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter, taken between two changes."""
        with self._lock:
            return dict(self._values)

    def __getitem__(self, name: str) -> int:
        """One counter's current value (take a :meth:`snapshot` to compare counters with each other)."""
        with self._lock:
            return self._values[name]

    def __repr__(self) -> str:
        return f"SpanCounters({self.snapshot()})"
