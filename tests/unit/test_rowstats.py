"""The per-token numbers of a logits row: the compiled helper, its numpy twin, and the definition.

A recorded margin or log-probability must not depend on how kvtrace was installed: the compiled
helper (each vector kernel this CPU runs) and the pure-numpy twin used where it was not built give
the same bits, and both equal an independent float64 recomputation from the logits.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvtrace.patches import rowstats

SIZES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 255, 256, 257, 4096, 32000, 32001, 32007, 151936)
"""Around the vector widths (4, 8, 16), the sum's 16 lanes and the 256-logit blocks; real vocabularies."""


def rows(seed: int = 0):
    """Logits rows as engines produce them, and the awkward ones: ties, masked (-inf) tokens, wide spreads."""
    rng = np.random.default_rng(seed)
    for case, n in enumerate(SIZES * 4):
        scale = (0.01, 1.0, 8.0, 60.0)[case % 4]
        row = (rng.standard_normal(n) * scale + rng.normal(0, 20)).astype(np.float32)
        if case % 3 == 0 and n > 3:
            row[rng.integers(n, size=3)] = row.max()  # a tie for top-1
        if case % 5 == 0 and n > 3:
            row[rng.integers(n, size=n // 3)] = -np.inf  # masked tokens
        if case % 7 == 0:
            row = np.round(row)  # many equal logits
        yield row, int(rng.integers(n))


def compiled_module():
    return pytest.importorskip("kvtrace.patches._rowstats",
                               reason="the compiled helper was not built (no C compiler at install)")


def reference(row: np.ndarray, token: int) -> tuple[int, int, float, float]:
    """The numbers recomputed in float64 with a stable sort, independently of kvtrace."""
    x = row.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    runner_up = int(order[1]) if x.size > 1 else -1
    margin = x[order[0]] - x[runner_up] if x.size > 1 else np.inf
    log_softmax = x - x.max() - np.log(np.exp(x - x.max()).sum())
    return int(order[0]), runner_up, float(margin), float(log_softmax[token])


def test_every_compiled_kernel_and_the_numpy_twin_give_the_same_bits():
    compiled = compiled_module()
    kernels = compiled.kernels()
    assert kernels[-1] == "portable" and compiled.KERNEL == kernels[0]  # the widest this CPU runs
    checked = 0
    try:
        for row, token in rows():
            twin = rowstats.row_stats_numpy(row.ctypes.data, row.size, token)
            for kernel in kernels:
                compiled.use_kernel(kernel)
                assert compiled.row_stats(row.ctypes.data, row.size, token) == twin, (kernel, row.size)
                checked += 1
    finally:
        compiled.use_kernel(kernels[0])
    assert checked == len(SIZES) * 4 * len(kernels)


def test_the_numbers_equal_an_independent_float64_recomputation():
    for row, token in rows(seed=1):
        top1, runner_up, margin, logprob = rowstats.row_stats(row.ctypes.data, row.size, token)
        ref_top1, ref_runner_up, ref_margin, ref_logprob = reference(row, token)
        assert (top1, runner_up) == (ref_top1, ref_runner_up)
        assert margin == ref_margin  # exact: the same float32 inputs
        assert logprob == pytest.approx(ref_logprob, abs=1e-6)


def test_equal_top_logits_give_a_zero_margin_and_the_lower_ids():
    row = np.zeros(1000, dtype=np.float32)
    row[[700, 300, 900]] = 5.0
    assert rowstats.row_stats(row.ctypes.data, row.size, 900)[:3] == (300, 700, 0.0)


def test_a_row_with_nan_or_infinite_logits_gets_numpys_semantics_on_every_path():
    for poison in (np.nan, np.inf):
        row = np.linspace(-3, 3, 5000, dtype=np.float32)
        row[1234] = poison
        expected = rowstats.nonfinite_row_stats(row, 7)
        assert expected[0] == 1234  # numpy's argmax: the first NaN, or the +inf
        np.testing.assert_equal(tuple(rowstats.row_stats(row.ctypes.data, row.size, 7)), tuple(expected))  # NaN == NaN
        assert rowstats.row_stats_numpy(row.ctypes.data, row.size, 7) is None  # the twin hands it over too


def test_a_token_outside_the_row_and_a_missing_row_are_errors_not_reads():
    row = np.zeros(64, dtype=np.float32)
    for compute in {rowstats.row_stats, rowstats.row_stats_numpy, rowstats._row_stats}:
        with pytest.raises(IndexError):
            compute(row.ctypes.data, row.size, 64)
        with pytest.raises(ValueError):
            compute(0, row.size, 0)


GetLogitsIth = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)


def test_the_context_reader_asks_llama_cpps_function_for_the_row_and_reads_it():
    """A stand-in for ``llama_get_logits_ith`` (a C function pointer, as the real one is) serves rows."""
    logits = np.random.default_rng(2).standard_normal((3, 32000)).astype(np.float32)
    logits[2, 17] = np.nan
    context = ctypes.c_int(0)  # any address: the stand-in checks it is the one it was given
    asked = []

    @GetLogitsIth
    def get_logits_ith(ctx, i):
        asked.append(i)
        assert ctx == ctypes.addressof(context)
        return logits[i].ctypes.data if i >= 0 else None  # NULL for a row llama.cpp does not have

    read = rowstats.context_reader(ctypes.cast(get_logits_ith, ctypes.c_void_p).value, ctypes.addressof(context),
                                   logits.shape[1])
    assert read(1, 5) == rowstats.row_stats(logits[1].ctypes.data, logits.shape[1], 5)
    np.testing.assert_equal(tuple(read(2, 5)), tuple(rowstats.nonfinite_row_stats(logits[2], 5)))
    with pytest.raises(ValueError, match="no logits for output row -1"):
        read(-1, 5)
    with pytest.raises(IndexError):
        read(0, 32000)
    assert asked == [1, 2, -1, 0]


def test_where_the_helper_is_not_built_the_numpy_twin_answers_the_same(monkeypatch):
    compiled = compiled_module()
    row = np.random.default_rng(3).standard_normal(32000).astype(np.float32)
    with_helper = rowstats.row_stats(row.ctypes.data, row.size, 11)
    monkeypatch.setattr(rowstats, "_row_stats", rowstats.row_stats_numpy)
    assert rowstats.row_stats(row.ctypes.data, row.size, 11) == with_helper
    assert compiled.row_stats(row.ctypes.data, row.size, 11) == tuple(with_helper)


# --- a sampler's step: every row of a batch in one call (vLLM) ------------------------------------


class Row(tuple):
    """A NamedTuple-like row type, as vLLM's patch passes its own."""

    __slots__ = ()


def a_batch(n: int, rows: int, seed: int, ids_dtype=np.int32, padding: int = 0):
    """``rows`` logits rows of ``n`` (inside a wider array when ``padding``: the rows are not
    back to back), the sampled ids as vLLM gives them ([rows, 1]) and a skip mask longer than the batch."""
    rng = np.random.default_rng(seed)
    wide = (rng.standard_normal((rows, n + padding)) * 4).astype(np.float32)
    logits = wide[:, :n]
    ids = rng.integers(n, size=(rows, 1)).astype(ids_dtype)
    skip = np.zeros(rows + 3, dtype=bool)
    return logits, ids, skip


def step_arguments(logits: np.ndarray, ids: np.ndarray, skip) -> tuple:
    return (logits.ctypes.data, logits.shape[0], logits.shape[1], logits.strides[0],
            ids.ctypes.data, ids.strides[0], ids.itemsize, skip)


def every_step_reader(monkeypatch):
    """The compiled helper with each kernel this CPU runs, then the numpy twin (as where it was not built)."""
    compiled = compiled_module()
    kernels = compiled.kernels()
    try:
        for kernel in kernels:
            compiled.use_kernel(kernel)
            yield kernel, rowstats.sampled_rows_reader(Row)
    finally:
        compiled.use_kernel(kernels[0])
    with monkeypatch.context() as patched:
        patched.setattr(rowstats, "_sampled_rows", rowstats.sampled_rows_numpy)
        yield "numpy", rowstats.sampled_rows_reader(Row)


def test_a_samplers_step_gives_every_rows_numbers_in_one_call_the_same_on_every_path(monkeypatch):
    batches = []
    for seed, (n, rows) in enumerate(((960, 1), (32000, 3), (257, 5), (151936, 2), (33, 4))):
        logits, ids, skip = a_batch(n, rows, seed, ids_dtype=(np.int32, np.int64)[seed % 2], padding=seed * 5)
        if rows > 2:
            skip[1] = True  # a partial prefill: sampled nothing
            logits[2, [3, 7]] = logits[2].max() + 1  # a tie for top-1 ...
            ids[2, 0] = 7  # ... and a random sampler drew the higher id
        if rows > 3:
            logits[3, 11] = np.nan
        batches.append((logits, ids, skip))
    expected = None
    for path, read in every_step_reader(monkeypatch):
        got = [read(*step_arguments(*batch)) for batch in batches]
        assert all(type(row) is Row for step in got for row in step), path
        if expected is None:
            expected = got
        np.testing.assert_equal(got, expected, err_msg=path)  # NaN == NaN: the same bits on every path

    for (logits, ids, skip), step in zip(batches, expected):
        for i, row in enumerate(step):
            token = int(ids[i, 0])
            if skip[i]:
                assert row == (token, -1, -1, 0.0, 0.0, 0.0)
                continue
            contiguous = np.ascontiguousarray(logits[i])
            top1, runner_up, margin, logprob = rowstats.row_stats(contiguous.ctypes.data, contiguous.size, token)
            if token != top1 and contiguous[token] == contiguous[top1]:
                top1, runner_up = token, top1
            np.testing.assert_equal(row, (token, top1, runner_up, margin, logprob, 1.0))
    tied = expected[2][2]
    assert tied[:4] == (7, 7, 3, 0.0)  # the drawn token tied with the maximum is the top-1


def test_a_greedy_step_over_a_batch_equals_an_independent_float64_recomputation():
    logits, ids, skip = a_batch(4096, 6, seed=7)
    ids[:, 0] = logits.argmax(axis=1)
    step = rowstats.sampled_rows_reader(Row)(*step_arguments(logits, ids, None))
    for i, (chosen, top1, runner_up, margin, logprob, sampled) in enumerate(step):
        ref_top1, ref_runner_up, ref_margin, ref_logprob = reference(logits[i], int(ids[i, 0]))
        assert (chosen, top1, runner_up, sampled) == (ref_top1, ref_top1, ref_runner_up, 1.0)
        assert margin == ref_margin
        assert logprob == pytest.approx(ref_logprob, abs=1e-6)


def test_a_skipped_row_is_not_read(monkeypatch):
    logits, ids, skip = a_batch(64, 2, seed=8)
    ids[1, 0] = 10**6  # a partial prefill's placeholder id: outside the row, and never looked at
    skip[1] = True
    for path, read in every_step_reader(monkeypatch):
        step = read(*step_arguments(logits, ids, skip))
        assert step[1] == (10**6, -1, -1, 0.0, 0.0, 0.0), path
        assert read(*step_arguments(logits[:0], ids, skip)) == [], path  # an empty step


def test_a_bad_step_is_an_error_not_a_read(monkeypatch):
    logits, ids, skip = a_batch(64, 2, seed=9)
    for path, read in every_step_reader(monkeypatch):
        address, rows, n, row_stride, ids_address, ids_stride, ids_size, _ = step_arguments(logits, ids, skip)
        outside = ids.copy()
        outside[0, 0] = 64
        with pytest.raises(IndexError):
            read(*step_arguments(logits, outside, skip))
        with pytest.raises(ValueError):
            read(0, rows, n, row_stride, ids_address, ids_stride, ids_size, skip)  # no logits
        with pytest.raises(ValueError):
            read(address, rows, n, row_stride, 0, ids_stride, ids_size, skip)  # no sampled ids
        with pytest.raises(ValueError):
            read(address, rows, n, row_stride, ids_address, ids_stride, 2, skip)  # int16 ids
        with pytest.raises(ValueError):
            read(address, rows, 0, row_stride, ids_address, ids_stride, ids_size, skip)  # an empty row
        with pytest.raises(ValueError):
            read(address, rows, n, row_stride, ids_address, ids_stride, ids_size, skip[:1])  # a short mask
        with pytest.raises(ValueError):
            read(address, rows, n, row_stride, ids_address, ids_stride, ids_size, skip.astype(np.int32))
        with pytest.raises(TypeError):
            rowstats.sampled_rows_reader(list)(*step_arguments(logits, ids, skip))
    for row_type in (list, dict):
        with pytest.raises(TypeError):
            rowstats.sampled_rows_numpy(rowstats.nonfinite_at, row_type, *step_arguments(logits, ids, skip))
