"""Sampler rows on their way from a step to the live requests.

Under the ``uni`` executor the sampler runs in the engine-core process and a step's rows wait in
:data:`PENDING` for the live requests, handed over in bulk once readable.  Under the ``mp``
executor it runs in a worker process, and the rows of a call whose output vLLM ships go to
:data:`SHIPMENT`, which :mod:`~kvtrace.patches.vllm.worker` attaches to that output.  A process does
one or the other, never both, so no row is counted twice.

Rows computed on a CUDA device are copied to pinned host memory without blocking and read only once
their event has completed: nothing here waits for the device on the engine's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from kvtrace.patches.vllm.live_requests import LIVE
from kvtrace.patches.vllm.row_stats import SampledRow
from kvtrace.patches.vllm.step_shape import row_steps


def readable_rows(rows: Any, skip: Any = None) -> list[SampledRow]:
    """A step's rows as :class:`SampledRow`: from host rows, a host tensor of device rows or a worker's
    plain numbers; ``skip`` (a host bool array, or ``None``) marks rows that sampled nothing."""
    if type(rows) is not list or (rows and type(rows[0]) is not SampledRow):
        values = rows.tolist() if hasattr(rows, "tolist") else rows
        rows = [SampledRow._make(row) for row in values]
    if skip is not None:
        rows = [row._replace(sampled=0.0) if skipped else row for row, skipped in zip(rows, skip)]
    return rows


class StepRows:
    """Steps' rows in order, each ``(request ids, rows, CUDA event or None, StepShape or None, skip mask or
    None)``; rows are a list of :class:`SampledRow` (host rows), a tensor (device rows, on the host once
    its event completed) or lists of numbers in :class:`SampledRow` order (a worker's)."""

    def __init__(self) -> None:
        self._steps: deque = deque()

    def __bool__(self) -> bool:
        return bool(self._steps)

    def put(self, req_ids: list[str], rows: Any, event: Optional[Any] = None, shape: Optional[tuple] = None,
            skip: Any = None) -> None:
        """A step's rows, one per request id, in order, its :class:`StepShape` and the host mask of its
        rows that sampled nothing."""
        self._steps.append((req_ids, rows, event, shape, skip))

    def clear(self) -> None:
        self._steps.clear()


class PendingRows(StepRows):
    """Rows for the live requests of this process.  Host rows wait here too, so a step costs an
    append and not a hand-over of its own (the engine core drains this before it finishes a request,
    and whenever rows arrive from a device or a worker)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # the engine's thread and the late-rows waiter both drain
        self.after_drain: Callable[[], None] = lambda: None
        """Called after every drain: requests whose end waited for their last rows (:mod:`.request_end`)."""

    def drain(self) -> None:
        """Hand every readable step to the live requests, in order, up to the first still on the device;
        never waits for the device."""
        req_ids: list[str] = []
        rows: list[SampledRow] = []
        steps: list = []
        with self._lock:
            while self._steps:
                step_ids, step_rows, event, shape, skip = self._steps[0]
                if event is not None and not event.query():
                    break
                self._steps.popleft()
                step_rows = readable_rows(step_rows, skip)
                req_ids += step_ids
                rows += step_rows
                steps += row_steps(shape, len(step_ids))
            if rows:
                LIVE.add_rows(req_ids, rows, steps)
        self.after_drain()

    def on_device(self) -> bool:
        """Whether rows are still waiting for the device (after a drain: any step left).  A drain running
        on another thread is waited for: the rows it took are with their requests when this says none."""
        with self._lock:
            return bool(self._steps)

    def wait(self, timeout: float) -> bool:
        """Off the engine's thread: wait up to ``timeout`` seconds until the last step queued now is
        readable (polled: a device wait would not time out).  Returns whether it is."""
        with self._lock:
            event = self._steps[-1][2] if self._steps else None
        deadline = time.monotonic() + timeout
        while event is not None and not event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True


class Shipment(StepRows):
    """Worker process (``mp`` executor): the rows of the running RPC, for the output it ships."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        """Whether the running RPC's output goes to the engine core (only then are rows computed)."""

    def take(self) -> list:
        steps = list(self._steps)
        self._steps.clear()
        return steps


PENDING = PendingRows()
SHIPMENT = Shipment()


def hand_over(req_ids: list[str], rows: list[SampledRow], shape: Optional[tuple]) -> None:
    """A step's host rows, of the first ``len(rows)`` of ``req_ids``, and its :class:`StepShape`: for
    this process's live requests, or (worker process) for the RPC's output."""
    (SHIPMENT if SHIPMENT.active else PENDING)._steps.append((req_ids[:len(rows)], rows, None, shape, None))  # put()


def queue_device_rows(req_ids: list[str], stats: Any, shape: Optional[tuple], skip: Any = None) -> None:
    """Queue a step's device rows (:func:`~.row_stats.device_rows`) for this process's records, or (worker
    process) for the RPC's output.  On CUDA they go to pinned host memory by a copy that does not block,
    ordered on vLLM's stream before vLLM's own copy of the sampled ids."""
    if not SHIPMENT.active:
        PENDING.drain()
    queue = SHIPMENT if SHIPMENT.active else PENDING
    if getattr(stats, "is_cuda", False):
        import torch  # deferred like device_rows's: present once rows live on a CUDA device

        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        queue.put(req_ids, host, event, shape, skip)
    else:
        queue.put(req_ids, stats, None, shape, skip)
