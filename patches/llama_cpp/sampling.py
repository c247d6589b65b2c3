"""Per-token margins: ``Llama.sample``.

Before the engine samples, the current step's raw logits row is read through a read-only
zero-copy view: top-1, runner-up and their margin.  After it, the chosen token and its
log-probability under the raw logits complete the entry.  The raw logits come before penalties,
grammar and logits processors, so the chosen token may differ from top-1; both are recorded.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional

import numpy as np

from kvtrace.patches.llama_cpp.calls import CALLS
from kvtrace.patches.llama_cpp.engine import FAILURES

SAMPLE_IDX_POSITION = 15
"""Position of ``idx`` among ``Llama.sample``'s arguments: ``sample(top_k, …, grammar, idx)``."""


def sample_wrapper(wrapped, instance, args, kwargs):
    state = CALLS.of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    decision = None
    try:
        idx = kwargs.get("idx", args[SAMPLE_IDX_POSITION] if len(args) > SAMPLE_IDX_POSITION else None)
        decision = raw_top2(instance, idx)
    except Exception:
        FAILURES.count("sample (logits)", state.recorder)
    token = wrapped(*args, **kwargs)
    if decision is not None:
        try:
            top1, runner_up, margin, row = decision
            state.record.add_token(int(token), top1, runner_up, margin, logprob(row, int(token), top1))
        except Exception:
            FAILURES.count("sample (record)", state.recorder)
    return token


def logits_row(llama: Any, idx: Optional[int]) -> np.ndarray:
    """The current step's raw logits as a read-only zero-copy view (valid until the next decode)."""
    ridx = idx - llama.n_tokens if idx is not None else -1
    pointer = llama._ctx.get_logits_ith(ridx)
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    if not address:
        raise ValueError(f"llama.cpp has no logits for output row {ridx}")
    # A view, not a copy (cheaper than np.ctypeslib.as_array); locked read-only so kvtrace cannot write logits.
    row = np.frombuffer(_float_array(int(llama._n_vocab)).from_address(address), dtype=np.float32)
    row.flags.writeable = False
    return row


@functools.lru_cache(maxsize=8)
def _float_array(n: int) -> type:
    return ctypes.c_float * n


def raw_top2(llama: Any, idx: Optional[int]) -> tuple[int, int, float, np.ndarray]:
    """(top-1 id, runner-up id, top-1 − top-2 margin, row) of the raw logits.

    Two vectorised passes and no copy: ``argmax`` of the row, then ``argmax``
    of the slices either side of it.  Ties go to the lower token id (as
    ``argmax`` does), so equal logits give a margin of exactly 0.
    """
    row = logits_row(llama, idx)
    top1 = int(row.argmax())
    runner_up, runner_value = -1, -np.inf
    if top1 > 0:
        runner_up = int(row[:top1].argmax())
        runner_value = float(row[runner_up])
    if top1 + 1 < row.shape[0]:
        right = top1 + 1 + int(row[top1 + 1:].argmax())
        if float(row[right]) > runner_value:
            runner_up, runner_value = right, float(row[right])
    return top1, runner_up, float(row[top1]) - runner_value, row


def logprob(row: np.ndarray, token: int, top1: int) -> float:
    """log-softmax of the raw logits at ``token`` (max-shifted for stability)."""
    peak = row[top1]
    total = np.exp(row - peak).sum(dtype=np.float64)  # float32 exp (SIMD), float64 accumulation
    return float(row[token] - peak - np.log(total))
