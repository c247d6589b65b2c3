"""Progress of a long command on stderr: a bar with an ETA on a terminal (tqdm), one log line every
few seconds without one (CI logs, ``nohup``, a file), nothing with ``--quiet``.

A command calls the progress object with what it is doing now, and counts units of work with
``start(total, unit)`` / ``advance(n)``; the ETA comes from the rate so far.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

from kvtrace.errors import ConfigError

LOG_INTERVAL_ENV = "KVTRACE_PROGRESS_SECONDS"
DEFAULT_LOG_INTERVAL = 30.0


class Progress:
    """Reports nothing (``--quiet``); the base of the two that do."""

    def __call__(self, message: str) -> None:
        """What the command is doing now (shown with the count, or alone before counting starts)."""

    def start(self, total: int, unit: str) -> None:
        """Count ``total`` units of work from now on."""

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""

    def close(self) -> None:
        """The counted work is over (a final line in a log)."""


class BarProgress(Progress):
    """A tqdm bar with rate and ETA on a terminal; a plain status line before counting starts."""

    def __init__(self, out: TextIO):
        self.out = out
        self.bar = None

    def __call__(self, message: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(message[-70:], refresh=True)
        else:
            self.out.write("\r\033[K" + message[:150])
            self.out.flush()

    def start(self, total: int, unit: str) -> None:
        from tqdm import tqdm  # deferred, heavy (~0.2 s): only a terminal that shows a bar needs it

        self.close()
        self.out.write("\r\033[K")
        self.bar = tqdm(total=total, unit=f" {unit}", file=self.out, dynamic_ncols=True, leave=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None and n:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LogProgress(Progress):
    """One line at most every ``interval`` seconds: count, share, elapsed time, ETA and the latest message."""

    def __init__(self, out: TextIO, interval: float = DEFAULT_LOG_INTERVAL):
        self.out, self.interval = out, interval
        self.message = ""
        self.total: Optional[int] = None
        self.unit = ""
        self.done = 0
        self.started = self.last = time.monotonic()  # a command done within the interval prints nothing

    def __call__(self, message: str) -> None:
        self.message = message
        self._maybe_print()

    def start(self, total: int, unit: str) -> None:
        self.total, self.unit, self.done = total, unit, 0
        self.started = time.monotonic()
        self._print()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._maybe_print()

    def close(self) -> None:
        if self.total is not None:
            self._print()
            self.total = None

    def _maybe_print(self) -> None:
        if time.monotonic() - self.last >= self.interval:
            self._print()

    def _print(self) -> None:
        now = time.monotonic()
        self.last = now
        parts = []
        if self.total is not None:
            elapsed = now - self.started
            share = self.done / self.total if self.total else 1.0
            eta = elapsed / self.done * (self.total - self.done) if self.done else None
            parts.append(f"{self.done}/{self.total} {self.unit} ({share:.0%}), {_duration(elapsed)} elapsed, "
                         f"ETA {_duration(eta) if eta is not None else '?'}")
        if self.message:
            parts.append(self.message)
        if parts:
            self.out.write(f"kvtrace: {time.strftime('%H:%M:%S')} " + " - ".join(parts) + "\n")
            self.out.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def log_interval() -> float:
    """Seconds between log lines: ``KVTRACE_PROGRESS_SECONDS`` (a number >= 0) or 30."""
    raw = os.environ.get(LOG_INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_LOG_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise ConfigError(f"{LOG_INTERVAL_ENV}={raw!r}: give the seconds between progress lines, a number >= 0")
    return value


def for_stderr(quiet: bool = False) -> Progress:
    """The progress a command shows on stderr: a bar on a terminal, log lines otherwise."""
    if quiet:
        return Progress()
    if sys.stderr.isatty():
        return BarProgress(sys.stderr)
    return LogProgress(sys.stderr, log_interval())
