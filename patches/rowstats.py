"""The per-token numbers of one raw logits row, in one call: top-1, runner-up, margin, log-probability.

For a row ``x`` of ``n`` float32 logits, all finite, and the chosen token ``t``:

* ``top1`` is the lowest id holding the maximum ``peak``; ``runner_up`` the lowest id other than
  ``top1`` holding the largest remaining logit (-1 when ``n == 1``): the first two of a stable
  descending sort;
* ``margin = float64(x[top1]) - float64(x[runner_up])`` (``inf`` when ``n == 1``), exact;
* ``logprob = (float64(x[t]) - float64(peak)) - log(S)``, the log-softmax at ``t``, where
  ``S = sum_i exp32(x[i] - peak)``: ``x[i] - peak`` in float32, ``exp32`` Cephes' ``expf`` in float32
  operations (0 below -87), summed in float64 in 16 lanes (lane ``j`` adds the ``i`` with
  ``i % 16 == j`` in index order, then the lanes are added in order).  Within about 1e-7 of the
  float64 log-softmax.

A row holding a NaN or an infinite logit gets numpy's argmax and exp semantics instead
(:func:`nonfinite_row_stats`).

:func:`row_stats` computes this with the compiled helper ``_rowstats`` (two vectorised passes
over the row, one call from Python) where it was built, and with :func:`row_stats_numpy`
otherwise.  :func:`context_reader` does the same for the row llama.cpp's ``llama_get_logits_ith``
returns, calling that function from the compiled helper: no Python frame and no ctypes call per
token.  :func:`sampled_rows_reader` does it for a sampler's whole step (vLLM's batch of rows and
sampled ids, given by address) in one call.  The definition fixes every float operation and the
order of the sum, so both give bit-identical results on every machine: a recorded log-probability
does not depend on how kvtrace was installed.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Callable, NamedTuple, Optional

import numpy as np


class RowStats(NamedTuple):
    """What one token's raw logits row says, by the definition above."""

    top1: int
    runner_up: int
    margin: float
    logprob: float
    """Of the token asked about (the chosen one)."""


LANES = 16
EXP_LOW = np.float32(-87.0)
LOG2E = np.float32(1.44269504088896341)
ROUNDER = np.float32(12582912.0)  # 1.5 * 2**23
ROUNDER_BITS = 0x4B400000
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
POLYNOMIAL = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                            1.6666665459e-1, 5.0000001201e-1))


def row_view(address: int, n: int) -> np.ndarray:
    """The ``n`` float32 logits at ``address`` as a read-only zero-copy view."""
    if not address:
        raise ValueError("no logits row (NULL address)")
    row = np.frombuffer(_float_array(n).from_address(address), dtype=np.float32)
    row.flags.writeable = False
    return row


@functools.lru_cache(maxsize=8)
def _float_array(n: int) -> type:
    return ctypes.c_float * n


def top_two(row: np.ndarray) -> tuple[int, int]:
    """(top1, runner_up) by the definition above; with NaNs, numpy's argmax (the first NaN wins)."""
    top1 = int(row.argmax())
    runner_up, runner_value = -1, -math.inf
    if top1 > 0:
        runner_up = int(row[:top1].argmax())
        runner_value = float(row[runner_up])
    if top1 + 1 < row.shape[0]:
        right = top1 + 1 + int(row[top1 + 1:].argmax())
        if runner_up < 0 or float(row[right]) > runner_value:
            runner_up = right
    return top1, runner_up


def _margin(row: np.ndarray, top1: int, runner_up: int) -> float:
    return float(row[top1]) - (float(row[runner_up]) if runner_up >= 0 else -math.inf)


def exp_sum(row: np.ndarray, peak: np.float32) -> float:
    """``S`` of the definition, operation for operation as ``_rowstats.c`` computes it."""
    d = row - peak
    x = np.maximum(d, EXP_LOW)
    t = x * LOG2E
    t += ROUNDER
    n = t - ROUNDER
    r = n * LN2_HI
    np.subtract(x, r, out=r)
    scratch = n * LN2_LO
    np.subtract(r, scratch, out=r)
    p = np.full_like(r, POLYNOMIAL[0])
    for coefficient in POLYNOMIAL[1:]:
        p *= r
        p += coefficient
    p *= r
    p *= r
    p += r
    p += np.float32(1.0)
    scale_bits = t.view(np.int32) - np.int32(ROUNDER_BITS - 127)
    scale_bits <<= 23
    p *= scale_bits.view(np.float32)
    p[d < EXP_LOW] = 0.0
    padded = np.zeros(-(-p.shape[0] // LANES) * LANES, dtype=np.float64)
    padded[: p.shape[0]] = p
    lanes = np.add.reduce(padded.reshape(-1, LANES), axis=0)  # row by row: each lane in index order
    total = 0.0
    for lane in lanes.tolist():
        total += lane
    return total


def row_stats_numpy(address: int, n: int, token: int) -> Optional[tuple[int, int, float, float]]:
    """:func:`row_stats` in numpy, bit-identical to the compiled helper; ``None`` for a non-finite row."""
    if not 0 <= token < n:
        raise IndexError(f"token {token} is outside the row of {n} logits")
    row = row_view(address, n)
    peak = row.max()
    if not np.isfinite(peak):
        return None
    total = exp_sum(row, peak)
    if not math.isfinite(total):
        return None
    top1, runner_up = top_two(row)
    return top1, runner_up, _margin(row, top1, runner_up), (float(row[token]) - float(peak)) - math.log(total)


def nonfinite_row_stats(row: np.ndarray, token: int) -> RowStats:
    """A row with NaN or infinite logits: numpy's argmax, and the log-softmax as numpy computes it."""
    top1, runner_up = top_two(row)
    peak = row[top1]
    with np.errstate(all="ignore"):
        total = np.exp(row - peak).sum(dtype=np.float64)
        logprob = float(row[token] - peak) - float(np.log(total))
    return RowStats(top1, runner_up, _margin(row, top1, runner_up), logprob)


GetLogitsIth = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
"""``float *llama_get_logits_ith(struct llama_context *ctx, int32_t i)``, the row as an address."""


def row_stats_at_numpy(get_logits_ith: int, ctx: int, n: int, nonfinite: Callable[[int, int, int], RowStats],
                       i: int, token: int) -> tuple[int, int, float, float]:
    """``_rowstats.row_stats_at`` in numpy: the row ``llama_get_logits_ith(ctx, i)`` points to."""
    address = GetLogitsIth(get_logits_ith)(ctx, i)
    if not address:
        raise ValueError(f"llama.cpp has no logits for output row {i}")
    stats = row_stats_numpy(address, n, token)
    return stats if stats is not None else nonfinite(address, n, token)


def nonfinite_at(address: int, n: int, token: int) -> RowStats:
    return nonfinite_row_stats(row_view(address, n), token)


def sampled_rows_numpy(nonfinite: Callable[[int, int, int], RowStats], row_type: type, address: int, rows: int,
                       n: int, row_stride: int, ids_address: int, ids_stride: int, ids_size: int,
                       skip: Optional[np.ndarray]) -> list:
    """``_rowstats.sampled_rows`` in numpy: a sampler's step over ``rows`` logits rows, one row each.

    Row ``i`` of the logits is the ``n`` float32 logits at ``address + i * row_stride``, and its
    sampled token the signed integer of ``ids_size`` bytes (4 or 8) at ``ids_address + i *
    ids_stride``; ``skip`` is ``None`` or a bool array whose true entries (at least ``rows`` of them)
    mark the rows that sampled no token.  Row ``i`` gives ``tuple.__new__(row_type, (chosen, top1,
    runner_up, margin, logprob, 1.0))`` by :func:`row_stats` (``row_type`` is a tuple subclass such as
    a NamedTuple), except that a chosen token tied with the maximum (a random sampler's draw) is the
    top-1 itself and the runner-up the lowest id holding the maximum; a skipped row gives
    ``(chosen, -1, -1, 0.0, 0.0, 0.0)`` and is not read.  A row with a NaN or infinite logit goes to
    ``nonfinite(address, n, token)``.
    """
    if not (isinstance(row_type, type) and issubclass(row_type, tuple)
            and row_type.__basicsize__ == tuple.__basicsize__):
        raise TypeError("row_type must be a tuple subclass without fields of its own (a NamedTuple)")
    if n <= 0:
        raise ValueError("the row is empty")
    if rows < 0:
        raise ValueError("rows must not be negative")
    if ids_size not in (4, 8):
        raise ValueError("sampled ids must be int32 or int64 (ids_size 4 or 8)")
    if rows > 0 and (not address or not ids_address):
        raise ValueError("no logits or no sampled ids (NULL address)")
    if skip is not None:
        skip = np.asarray(skip)
        if skip.ndim != 1 or skip.itemsize != 1 or skip.dtype.kind not in "biu" or skip.shape[0] < rows:
            raise ValueError("skip must be a bool array with at least one entry per logits row")
    id_type = ctypes.c_int32 if ids_size == 4 else ctypes.c_int64
    out = []
    for i in range(rows):
        token = id_type.from_address(ids_address + i * ids_stride).value
        if skip is not None and skip[i]:
            out.append(tuple.__new__(row_type, (token, -1, -1, 0.0, 0.0, 0.0)))
            continue
        row_address = address + i * row_stride
        stats = row_stats_numpy(row_address, n, token) or nonfinite(row_address, n, token)
        top1, runner_up, margin, logprob = stats
        row = row_view(row_address, n)
        if token != top1 and row[token] == row[top1]:  # a random sampler took a token tied with the maximum
            top1, runner_up = token, top1
        out.append(tuple.__new__(row_type, (token, top1, runner_up, float(margin), float(logprob), 1.0)))
    return out


def _load_compiled():
    try:  # imported here to catch its absence: the extension is optional (built where a C compiler was)
        from kvtrace.patches import _rowstats
    except ImportError:
        return None
    return _rowstats


COMPILED = _load_compiled()
"""The compiled helper (``row_stats``, ``row_stats_at``, ``sampled_rows``), ``None`` where it was not built."""

_row_stats = COMPILED.row_stats if COMPILED is not None else row_stats_numpy
_row_stats_at = COMPILED.row_stats_at if COMPILED is not None else row_stats_at_numpy
_sampled_rows = COMPILED.sampled_rows if COMPILED is not None else sampled_rows_numpy


def row_stats(address: int, n: int, token: int) -> RowStats:
    """(top1, runner_up, margin, logprob) of the ``n`` float32 logits at ``address`` for ``token``.

    Raises ``IndexError`` for a token outside the row and ``ValueError`` for a NULL address.
    """
    stats = _row_stats(address, n, token)
    return RowStats(*stats) if stats is not None else nonfinite_row_stats(row_view(address, n), token)


def context_reader(get_logits_ith: int, ctx: int, n: int) -> Callable[[int, int], tuple[int, int, float, float]]:
    """``read(i, token)``: (top1, runner_up, margin, logprob) of the row ``llama_get_logits_ith(ctx, i)``.

    ``get_logits_ith`` is the address of llama.cpp's function, ``ctx`` of its ``llama_context``;
    both must stay valid while ``read`` is used.  ``read`` raises ``ValueError`` where llama.cpp has
    no row ``i`` and ``IndexError`` for a token outside it.
    """
    return functools.partial(_row_stats_at, get_logits_ith, ctx, n, nonfinite_at)


def sampled_rows_reader(row_type: type) -> Callable[..., list]:
    """``read(address, rows, n, row_stride, ids_address, ids_stride, ids_size, skip)``: a sampler's step,
    one ``row_type`` (chosen, top1, runner_up, margin, logprob, sampled) per logits row, in one call
    (:func:`sampled_rows_numpy` says what each argument and number is).

    The memory the addresses point into must stay valid during the call.  ``read`` raises
    ``ValueError`` for a NULL address or an ``ids_size`` other than 4 or 8 and ``IndexError`` for a
    sampled token outside its row.
    """
    return functools.partial(_sampled_rows, nonfinite_at, row_type)
