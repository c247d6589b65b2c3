"""What one engine step computed: the batch each sampled row came from.

Each step's rows carry its :class:`StepShape`, read from what the runner prepared for the step (one
tuple per step), expanded per request only when the rows reach the live requests: the batch
composition of every generated token and the prompt's prefill split.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from kvtrace.patches.vllm.common import FAILURES


class StepShape(NamedTuple):
    """One step's batch.  Carried as a plain tuple, built in the step and shipped from a worker
    process as such: these fields name its positions."""

    rows: int  # sequences the step held (its logits rows; partial prefills included)
    tokens: int  # tokens it computed over all of them
    row_tokens: Optional[list[int]]  # each row's computed tokens; ``None`` when every row computed one


def step_shape_v1(starts: Any, rows: int) -> Optional[tuple]:
    """The V1 runner's step as a :class:`StepShape`, from its ``query_start_loc`` host buffer (the step's
    cumulative tokens per row, ``_prepare_inputs``; a memoryview or an array); the per-row split is
    taken only for a step with a prefill chunk."""
    try:
        tokens = int(starts[rows])
        if tokens == rows:
            return (rows, tokens, None)
        return (rows, tokens, [int(starts[i + 1]) - int(starts[i]) for i in range(rows)])
    except Exception:
        FAILURES.count("batch composition (V1 runner)")
        return None


def step_shape_v2(batch: Any, rows: int) -> Optional[tuple]:
    """The V2 runner's step (its ``InputBatch``, host arrays) as a :class:`StepShape`."""
    try:
        tokens = int(batch.num_tokens)
        return (rows, tokens, None) if tokens == rows else (rows, tokens, batch.num_scheduled_tokens[:rows].tolist())
    except Exception:
        FAILURES.count("batch composition (V2 runner)")
        return None


UNKNOWN_STEP = (0, 0, 0)
"""A row's step whose shape was not read: no step holds zero rows (and a finished request's arrays are
checked with one scan of small ints, not a comparison of tuples)."""


def row_steps(shape: Optional[tuple], count: int) -> list:
    """A step's shape for each of its first ``count`` rows: ``(rows, tokens, this row's tokens)``, one
    shared tuple when every row computed one token; :data:`UNKNOWN_STEP` when the step's shape is unknown."""
    if shape is None:
        return [UNKNOWN_STEP] * count
    rows, tokens, row_tokens = shape
    if row_tokens is None:
        return [(rows, tokens, 1)] * count
    return [(rows, tokens, q) for q in row_tokens[:count]]
