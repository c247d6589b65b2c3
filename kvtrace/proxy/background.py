"""Work the proxy does after a client has its answer, on threads of its own.

A keep-alive client sends its next request on the connection that served the last one, so the
record of a request (reading llama-server's log for its task, tokenizing its prompt) must not hold
that connection's thread. Each record gets a thread while fewer than ``limit`` run; beyond that it
runs on the caller's thread, as back-pressure: a record is never queued without bound, never dropped.

A thread that finished its job waits a while for the next one: handing a job to a waiting thread
costs about a seventh of starting one (14 against 100 µs of CPU), once per request.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

log = logging.getLogger("kvtrace")

IDLE_S = 10.0
"""How long a thread without a job waits for one before it ends."""


class Background:
    def __init__(self, limit: int, name: str = "kvtrace-proxy-record", idle_s: float = IDLE_S):
        self._limit = limit
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._all_done = threading.Condition(self._lock)
        self._job_waiting = threading.Condition(self._lock)
        self._jobs: deque[Callable[[], None]] = deque()  # handed to a waiting thread, not yet taken
        self._threads = 0  # threads of this set, running a job or waiting for one (never above limit)
        self._waiting = 0  # of those, waiting for a job
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
        with self._lock:
            if self._closed:
                return False
            if self._waiting > len(self._jobs):  # a thread waits that no job was handed to yet
                self._jobs.append(job)
                self._running += 1
                self._job_waiting.notify()
                return True
            if self._threads >= self._limit:
                return False
            self._threads += 1
            self._running += 1
        try:
            threading.Thread(target=self._serve, args=(job,), name=self._name, daemon=True).start()
        except RuntimeError:  # no thread to be had: as beyond the limit
            with self._lock:
                self._threads -= 1
            self._done()
            return False
        return True

    def hold(self) -> Callable[[], None]:
        """A job whose end runs later, on another thread (a record parked until the one its state came from
        is made): :meth:`close` waits for it until the function returned is called, once."""
        with self._lock:
            self._running += 1
        return self._done

    def _serve(self, job: Callable[[], None]) -> None:
        while True:
            try:
                job()
            except Exception:  # the job counts its own failures; this is a last guard for the thread
                log.warning("kvtrace proxy: a job of %s failed", self._name, exc_info=True)
            finally:
                self._done()
            with self._lock:
                self._waiting += 1
                while not self._jobs and not self._closed:
                    if not self._job_waiting.wait(self._idle_s):
                        break
                self._waiting -= 1
                if not self._jobs:
                    self._threads -= 1
                    return
                job = self._jobs.popleft()

    def _done(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                self._all_done.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the running jobs (their spans go out before the proxy's recorder flushes)."""
        with self._lock:
            self._closed = True
            self._job_waiting.notify_all()
            self._all_done.wait_for(lambda: not self._running, timeout_s)
