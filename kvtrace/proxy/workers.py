"""``kvtrace proxy --workers N``: N proxy processes on one port, each with its own GIL.

The kernel spreads client connections over the workers' listening sockets (``SO_REUSEPORT``). Each
worker is a whole proxy: its own upstream connections, recorder and spool file, and its own reading of
llama-server's log, where it claims only its own requests by their markers (each worker sends
markers of its own lane, so no two workers send the same one). What must hold for the proxy as a
whole is shared: the shadow budget (:mod:`shadow_ledger`). The limits are per worker
(docs/proxy.md, "Workers").

This process only supervises: it keeps the port bound while workers come and go, restarts a worker
that dies (what the dead one spooled stays in its spool file, for ``kvtrace ingest``), and on SIGINT or
SIGTERM stops every worker, each flushing its spans, then exits.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvtrace.errors import ConfigError
from kvtrace.proxy.limits import Limits, ShadowBudget
from kvtrace.proxy.shadow_ledger import ShadowLedger

log = logging.getLogger("kvtrace.proxy")

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 120.0
RESTART_PAUSE_S = 1.0
"""A worker that dies at once is not restarted in a tight loop."""


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker serves: the arguments of :func:`kvtrace.proxy.app.serve`, less the workers."""

    upstream: str
    host: str
    port: int
    llama_server_log: Optional[Path]
    limits: Limits
    shadow: Optional[ShadowBudget]
    pin: bool = False
    """Each worker kept to a CPU of its own (:mod:`cpu_affinity`)."""


def serve_workers(plan: WorkerPlan, workers: int, on_listening: Optional[Callable[[int], None]] = None) -> None:
    """Run ``workers`` proxy processes on ``plan.host:plan.port`` until SIGINT or SIGTERM."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or locks of this one's
    reserved = socket.socket(socket.AF_INET6 if ":" in plan.host else socket.AF_INET, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((plan.host, plan.port))  # bound, never listening: it holds the port, takes no connection
    port = reserved.getsockname()[1]
    plan = dataclasses.replace(plan, port=port)
    ledger = ShadowLedger(plan.shadow, context) if plan.shadow else None
    ready = context.SimpleQueue()
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda signum, frame: stop.set())

    def start(index: int) -> Any:
        process = context.Process(target=_worker, args=(plan, index, workers, ledger, ready),
                                  name=f"kvtrace-proxy-worker-{index}", daemon=False)
        process.start()
        return process

    processes = [start(index) for index in range(workers)]
    try:
        _wait_until_listening(processes, ready, workers, stop)
        if on_listening is not None and not stop.is_set():
            on_listening(port)
        while not stop.wait(0.5):
            for index, process in enumerate(processes):
                if process.exitcode is not None and not stop.is_set():
                    log.warning("kvtrace proxy: worker %d (pid %d) exited with %s; starting another", index,
                                process.pid, process.exitcode)
                    time.sleep(RESTART_PAUSE_S)
                    processes[index] = start(index)
    finally:
        _stop_all(processes)
        reserved.close()


def _wait_until_listening(processes: list, ready: Any, workers: int, stop: threading.Event) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    listening = 0
    while listening < workers and not stop.is_set():
        if any(p.exitcode is not None for p in processes):
            failure = ready.get() if not ready.empty() else None
            why = failure[1] if failure and failure[0] == "failed" else "see its message above"
            raise ConfigError(f"kvtrace proxy: a worker could not start ({why})")
        if time.monotonic() > deadline:
            raise ConfigError(f"kvtrace proxy: the workers did not start listening within {START_TIMEOUT_S:g} s")
        if ready.empty():
            time.sleep(0.05)
            continue
        what, detail = ready.get()
        if what == "failed":
            raise ConfigError(f"kvtrace proxy: a worker could not start ({detail})")
        listening += 1


def _stop_all(processes: list) -> None:
    for process in processes:
        if process.exitcode is None:
            process.terminate()  # SIGTERM: a normal stop, the worker flushes its spans
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            log.warning("kvtrace proxy: worker pid %d did not stop in %g s; killed", process.pid, STOP_TIMEOUT_S)
            process.kill()
            process.join(5)


def _worker(plan: WorkerPlan, index: int, workers: int, ledger: Optional[ShadowLedger], ready: Any) -> None:
    """One worker process: the proxy of :func:`kvtrace.proxy.app.serve` on the shared port."""
    from kvtrace.proxy.app import serve

    try:
        serve(plan.upstream, plan.host, plan.port, plan.llama_server_log,
              on_listening=lambda port: ready.put(("listening", index)), limits=plan.limits, shadow=plan.shadow,
              ledger=ledger, lane=(index, workers), pin=plan.pin)
    except (ConfigError, OSError) as exc:
        ready.put(("failed", str(exc)))
        raise SystemExit(2) from None
