"""``kvtrace proxy --pin-workers``: each worker process kept to one CPU of its own.

Kept to one CPU, the GIL's hand-over between a worker's threads wakes no other core and no thread
migrates; opt-in, since a pinned worker cannot leave a CPU something else keeps busy (docs/proxy.md,
"Workers", has the figures).
"""

from __future__ import annotations

import os

from kvtrace.errors import ConfigError


def supported() -> bool:
    """Whether this platform can keep a process to a CPU (Linux can; macOS and Windows cannot)."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def cpu_of_worker(index: int) -> int:
    """The CPU worker ``index`` keeps to: the ``index``-th of those this process may run on, in turn (more
    workers than CPUs share them)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[index % len(allowed)]


def keep_to(cpu: int) -> None:
    """Every thread of this process on ``cpu`` alone; the threads it starts later inherit it."""
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), {cpu})
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
    except OSError as exc:
        raise ConfigError(f"--pin-workers: cannot keep a worker to CPU {cpu} ({exc.strerror or exc}); "
                          "run without --pin-workers") from None
