"""The end of a request: its sampled rows become the output tokens' arrays, and the record a span.

``Scheduler._free_request`` runs on the engine core's thread, which must never wait for the device:
under async scheduling the device is already computing the next step.  So a request is finished at
once when its rows are all readable (on the host path always, and on a GPU normally: vLLM has waited
for its own copy of the step's sampled ids, which the stream ordered after kvtrace's).  Otherwise it
is held: rows that arrive later still reach it, and it is finished after the next drain that gives
it every row, by the waiter thread within :data:`LATE_ROWS_WAIT_S`, or when tracing stops (``unpatch()``,
the recorder's ``shutdown()``, exit).

Each row's chosen id is checked against the output token at its position: at the first that differs
(async scheduling, stop strings and preemption discard sampled tokens) the arrays stop, the request is
marked (``semconv.OUTPUT_ROWS_CUT_AT``) and counted (``rows_misaligned``); rows are never shifted.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Optional

from kvtrace import semconv as sc
from kvtrace.patches.vllm.common import FAILURES
from kvtrace.patches.vllm.live_requests import LIVE, LiveRequest
from kvtrace.patches.vllm.pending_rows import PENDING
from kvtrace.recording.records import RequestRecord

LATE_ROWS_WAIT_S = 2.0
"""How long a freed request waits for rows still on the device before it is finished without them."""


class Ending:
    """What a freed request is finished with: vLLM's output ids and finish reason, read when it was freed."""

    __slots__ = ("outputs", "reason", "deadline")

    def __init__(self, outputs: list[int], reason: Optional[str], deadline: float):
        self.outputs = outputs
        self.reason = reason
        self.deadline = deadline


def on_free(request: Any) -> None:
    """``Scheduler._free_request(request)``, before vLLM frees it."""
    PENDING.drain()
    internal_id = str(request.request_id)
    ending = None
    if LIVE.get(internal_id) is not None:
        reason = request.get_finished_reason() if hasattr(request, "get_finished_reason") else None
        ending = Ending(list(map(int, getattr(request, "output_token_ids", []))),
                        str(reason) if reason is not None else None, time.monotonic() + LATE_ROWS_WAIT_S)
    live = LIVE.end(internal_id, ending)
    if live is None:
        return
    if len(live.sampled_rows) < len(ending.outputs) and PENDING.on_device():
        _finish_at_shutdown(live.recorder)
        WAITER.wake()
    finish_ready()  # this one when its rows are all here (and any other held one ready now)


def finish_ready(force: bool = False) -> None:
    """Finish every held request that has all its rows, whose wait ran out, or (``force``, or nothing
    left on the device) any held one.  Runs after every drain."""
    if not LIVE.ending_count:
        return
    now = time.monotonic()
    nothing_left = not PENDING.on_device()
    for live in LIVE.take_endings(lambda live: force or nothing_left or now >= live.ending.deadline
                                  or len(live.sampled_rows) >= len(live.ending.outputs)):
        finish(live)


def finish_held() -> None:
    """Finish every held request now, with the rows the device has given so far (tracing stops)."""
    PENDING.drain()
    finish_ready(force=True)


_FINISHING_AT_SHUTDOWN: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _finish_at_shutdown(recorder: Any) -> None:
    """A recorder that a held request will go to finishes the held requests first when it shuts down
    (``Recorder.shutdown()``, at exit too), while their spans can still go out."""
    if recorder not in _FINISHING_AT_SHUTDOWN:
        _FINISHING_AT_SHUTDOWN.add(recorder)
        recorder.before_shutdown(finish_held)


def finish(live: LiveRequest) -> None:
    """The record of a freed request, its rows read into its arrays, to the recorder.  Never raises."""
    record = live.record
    try:
        fill_outputs(record, live)
    except Exception:
        FAILURES.count("request end", live.recorder)
    live.recorder.finish(record)


def fill_outputs(record: RequestRecord, live: LiveRequest) -> None:
    outputs = live.ending.outputs
    record.output_token_ids = outputs
    record.finish_reason = live.ending.reason
    rows = live.sampled_rows[:len(outputs)]
    if not rows or not outputs:
        return  # no rows reached this process (an executor that does not ship them): ids only
    # column by column (the rows' order is SampledRow's), not a call per token
    chosen, top1, runner_up, margins, logprobs, _ = zip(*rows)
    kept = len(rows)
    chosen_ids = list(map(int, chosen))
    if chosen_ids != outputs[:kept]:
        kept = next(i for i, (row, token) in enumerate(zip(chosen_ids, outputs)) if row != token)
        record.rows_cut_at, record.rows_cut_reason = kept, sc.ROWS_MISALIGNED
        live.recorder.pipeline.counters.add("rows_misaligned")
    elif kept < len(outputs):  # the last rows did not come (held past the wait, or never sent)
        record.rows_cut_at, record.rows_cut_reason = kept, sc.ROWS_LATE
        live.recorder.pipeline.counters.add("rows_late")
    record.top1_ids = list(map(int, top1[:kept]))
    record.runner_up_ids = list(map(int, runner_up[:kept]))
    record.margins = list(margins[:kept])
    record.logprobs = list(logprobs[:kept])
    if kept == len(outputs):
        _fill_batch_composition(record, live, kept)


def _fill_batch_composition(record: RequestRecord, live: LiveRequest, tokens: int) -> None:
    """Each output token's step (rows, tokens) and the prompt's prefill split, when every step of the
    request was seen: its partial prefills, then the chunk of the step that sampled token 0."""
    steps = live.row_steps[:tokens]
    if not steps or len(steps) < tokens:
        return
    step_rows, step_tokens, row_tokens = zip(*steps)
    if 0 in step_rows or 0 in live.partial_prefills:  # a step whose shape was not read
        return
    record.step_rows = list(step_rows)
    record.step_tokens = list(step_tokens)
    record.prefill_steps = live.partial_prefills + [row_tokens[0]]
    record.batch_composition = sc.BATCH_RECORDED


class LateRowsWaiter:
    """A daemon thread that finishes held requests when the engine's thread does not get to: it waits
    (polling, off the engine's thread) for the rows on the device, then drains.  Started on the first
    held request; when the recorder shuts down (at exit too), every held request is finished first."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvtrace-late-rows", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                while LIVE.ending_count:
                    PENDING.wait(LATE_ROWS_WAIT_S / 4)
                    PENDING.drain()  # finishes what has its rows
                    finish_ready()  # and what ran past its wait
                    time.sleep(0.001)
            except Exception:
                FAILURES.count("late rows")


WAITER = LateRowsWaiter()
PENDING.after_drain = finish_ready
