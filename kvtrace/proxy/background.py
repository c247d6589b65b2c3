"""Work the proxy does after a client has its answer, on threads of its own.

A keep-alive client sends its next request on the connection that served the last one, so the
record of a request (reading llama-server's log for its task, tokenizing its prompt) must not hold
that connection's thread. Each record gets a thread while fewer than ``limit`` run; beyond that it
runs on the caller's thread, as back-pressure: a record is never queued without bound, never dropped.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("kvtrace")


class Background:
    def __init__(self, limit: int, name: str = "kvtrace-proxy-record"):
        self._room = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._all_done = threading.Condition(self._lock)
        self._running = 0  # jobs handed to a thread, started or not: what close() waits for
        self._closed = False
        self._name = name

    def run(self, job: Callable[[], None]) -> None:
        """``job()`` on a thread of its own, or here when ``limit`` are running or after :meth:`close`."""
        if not self.try_run(job):
            job()

    def try_run(self, job: Callable[[], None]) -> bool:
        """``job()`` on a thread of its own if fewer than ``limit`` run (and not closed); else ``False``,
        and nothing runs."""
        if not self._room.acquire(blocking=False):
            return False
        with self._lock:
            if self._closed:
                self._room.release()
                return False
            self._running += 1
        try:
            threading.Thread(target=self._run, args=(job,), name=self._name, daemon=True).start()
        except RuntimeError:  # no thread to be had: as beyond the limit
            self._done()
            return False
        return True

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # the job counts its own failures; this is a last guard for the thread
            log.warning("kvtrace proxy: a job of %s failed", self._name, exc_info=True)
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                self._all_done.notify_all()
        self._room.release()

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the running jobs (their spans go out before the proxy's recorder flushes)."""
        with self._lock:
            self._closed = True
            self._all_done.wait_for(lambda: not self._running, timeout_s)
