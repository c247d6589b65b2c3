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
