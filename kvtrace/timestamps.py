"""Which points in time kvtrace can store, and reading epoch numbers of unknown unit.

``otel_traces.Timestamp`` is ``DateTime64(9)``, and query results come back
as nanosecond datetimes: a time after 2262-04-11 (2**63 - 1 ns) cannot be
held, and one that slips in breaks every later query that reads the column.
So every timestamp is checked here before it is stored: ingest and import
reject what falls outside, with a message naming the year it would be.
Zero is allowed: OTLP uses it for "not set".
"""

from __future__ import annotations

import math
from typing import Any

LATEST_NS = 2**63 - 1
"""2262-04-11T23:47:16.854775807Z, the last nanosecond an Int64 (and DateTime64(9)) holds."""

_NS_PER_YEAR = 365.2425 * 86400 * 1e9


class ImplausibleTime(ValueError):
    """A timestamp that cannot be a real time kvtrace can store (the message says why)."""


def _year(ns: float) -> str:
    return f"year {1970 + ns / _NS_PER_YEAR:,.0f}"


def check_unix_nanos(value: int, what: str) -> int:
    """``value`` if it is a storable Unix time in nanoseconds (or 0, "unset"); else ImplausibleTime."""
    if value < 0:
        raise ImplausibleTime(f"{what} {value} is before 1970")
    if value > LATEST_NS:
        raise ImplausibleTime(f"{what} {value} is in the {_year(value)}; kvtrace stores times up to 2262-04-11")
    return value


def unix_nanos(value: Any, what: str) -> int:
    """An OTLP ``*UnixNano`` field (a JSON integer, or a decimal string as proto3 JSON writes int64)."""
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise ImplausibleTime(f"{what} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ImplausibleTime(f"{what} must be a finite integer, got {value!r}")
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ImplausibleTime(f"{what} must be an integer, got {value[:40]!r}") from None
    elif not isinstance(value, int):
        raise ImplausibleTime(f"{what} must be an integer, got {type(value).__name__}")
    return check_unix_nanos(value, what)


EPOCH_UNITS = ((1e11, 1e9, "seconds"), (1e14, 1e6, "milliseconds"), (1e17, 1e3, "microseconds"),
               (LATEST_NS + 1, 1, "nanoseconds"))
"""(below, nanoseconds per unit, name): an epoch number below 1e11 is seconds (until year 5138),
below 1e14 milliseconds, below 1e17 microseconds, else nanoseconds.  Today's time in any of the four
units lands in its own band, so logs written in any of them import at the right time."""


def epoch_number_to_nanos(value: float | int, what: str) -> int:
    """An epoch number whose unit is read from its magnitude (see ``EPOCH_UNITS``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ImplausibleTime(f"{what} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ImplausibleTime(f"{what} {value!r} is not a finite number")
    if value < 0:
        raise ImplausibleTime(f"{what} {value!r} is before 1970")
    for below, scale, _unit in EPOCH_UNITS:
        if value < below:
            whole = int(value)  # whole units exactly, then the fraction: 1718000000.25 s is ...250000000 ns
            return check_unix_nanos(whole * int(scale) + round((value - whole) * scale), what)
    raise ImplausibleTime(f"{what} {value!r} is too large to be a time in seconds, milliseconds, microseconds "
                          "or nanoseconds since 1970")
