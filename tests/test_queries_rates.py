"""An experiment: repeat passes of a cache-reuse arm and a cache-off arm over the same episodes.
One reuse pass forks on 4 of 10 episodes; the saved rate queries must count that per
configuration with Wilson intervals, and measure the margin shift and top-1 flips at matched
positions of cache hits against recomputes."""

from __future__ import annotations

import math

import pytest

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import queries
from kvtrace import semconv as sc

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
FIRST = [10, 11, 12]
NEXT = PROMPT + FIRST + [20]
SECOND = [30, 31, 32, 33]
OFF_MARGINS = [1.0, 0.5, 0.04, 2.0]
FORKED = range(4)  # episodes on which pass 2 of the reuse arm forks


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("rates")
    book = ScenarioBook(root / "spool")
    reuse = CachePath(sc.LAYER_KV_REUSE, 8, event=sc.EVENT_CACHE_REUSE)
    # The cache-off passes come first, so they are the reference recomputes of every prompt.
    for run in ("exp-off-1", "exp-off-2"):
        for e in range(10):
            book.turn(run, f"e{e}", 0, PROMPT + [e], FIRST, arm="off")
            book.turn(run, f"e{e}", 1, NEXT + [e], SECOND, OFF_MARGINS, arm="off")
    for run in ("exp-reuse-1", "exp-reuse-2"):
        for e in range(10):
            book.turn(run, f"e{e}", 0, PROMPT + [e], FIRST, arm="reuse")
            if run == "exp-reuse-2" and e in FORKED:
                book.turn(run, f"e{e}", 1, NEXT + [e], [30, 31, 99, 98], [1.01, 0.51, 0.03, 1.5],
                          cache=reuse, arm="reuse")
            else:
                book.turn(run, f"e{e}", 1, NEXT + [e], SECOND, [m + 0.01 for m in OFF_MARGINS],
                          cache=reuse, arm="reuse")
    # A quantized configuration with a larger shift, and a run outside the experiment's prefix.
    book.turn("exp-q4-off", "q", 0, PROMPT, SECOND, OFF_MARGINS, arm="off", weight_format="Q4_K_M")
    book.turn("exp-q4-reuse", "q", 0, PROMPT, SECOND, [m + 0.2 for m in OFF_MARGINS], cache=reuse,
              arm="reuse", weight_format="Q4_K_M")
    book.turn("other-reuse", "e0", 0, PROMPT + [0], [5], arm="reuse")
    # Two cache hits of another configuration; one has token ids but no margins (an engine path that
    # ships no per-token statistics).
    for episode, hit_margins in (("with-margins", OFF_MARGINS), ("ids-only", [])):
        book.turn("q8-off", episode, 0, PROMPT + [len(hit_margins)], SECOND, OFF_MARGINS, arm="off",
                  weight_format="Q8_0")
        book.turn("q8-reuse", episode, 0, PROMPT + [len(hit_margins)], SECOND, hit_margins, cache=reuse,
                  arm="reuse", weight_format="Q8_0")
    connection = connect(f"chdb://{root / 'db'}")
    init_schema(connection)
    book.ingest(connection)
    yield connection
    connection.close()


def _by(client, name, keys, **params):
    columns, rows = queries.run(client, name, params)
    return {tuple(dict(zip(columns, r))[k] for k in keys): dict(zip(columns, r)) for r in rows}


def test_repeat_passes_of_one_configuration(client):
    rates = _by(client, "divergence_rates", ("weight_format", "arm"), run_prefix="exp-")
    reuse = rates[("F16", "reuse")]
    assert (reuse["runs"], reuse["pairs"], reuse["episodes_compared"], reuse["episodes_forked"]) == (2, 1, 10, 4)
    assert reuse["fork_rate"] == pytest.approx(0.4)
    assert (reuse["ci_low"], reuse["ci_high"]) == pytest.approx(wilson(4, 10))
    assert (reuse["median_fork_turn"], reuse["median_fork_position"]) == (1, 2)
    assert reuse["mean_cached_tokens"] == pytest.approx(4.0)  # 8 tokens on every second request
    off = rates[("F16", "off")]
    assert (off["episodes_compared"], off["episodes_forked"], off["ci_low"]) == (10, 0, 0.0)
    assert off["ci_high"] == pytest.approx(wilson(0, 10)[1])
    assert math.isnan(off["median_fork_turn"])
    # Q4_K_M has one run per arm: no within-configuration pair.
    assert ("Q4_K_M", "reuse") not in rates


def test_every_arm_against_a_baseline_arm(client):
    rates = _by(client, "divergence_rates", ("weight_format", "arm"), run_prefix="exp-", baseline_arm="off")
    reuse = rates[("F16", "reuse")]
    assert (reuse["compared_with"], reuse["pairs"], reuse["episodes_compared"], reuse["episodes_forked"]) == (
        "off", 4, 40, 8)
    assert (reuse["ci_low"], reuse["ci_high"]) == pytest.approx(wilson(8, 40))
    q4 = rates[("Q4_K_M", "reuse")]
    assert (q4["pairs"], q4["episodes_compared"], q4["episodes_forked"]) == (1, 1, 0)


def test_prefix_limits_the_runs(client):
    rates = _by(client, "divergence_rates", ("weight_format", "arm"), run_prefix="")
    assert rates[("F16", "reuse")]["runs"] == 3  # other-reuse joins the configuration


def test_margin_shift_at_matched_positions(client):
    shift = _by(client, "margin_shift", ("weight_format",), run_prefix="exp-")
    f16 = shift[("F16",)]
    # 16 unforked hits x 4 positions at +0.01; 4 forked hits x 3 positions (through the fork), last -0.01.
    assert (f16["request_pairs"], f16["positions"]) == (20, 76)
    assert f16["mean_shift"] == pytest.approx((72 * 0.01 - 4 * 0.01) / 76)
    assert f16["mean_abs_shift"] == pytest.approx(0.01)
    assert f16["max_abs_shift"] == pytest.approx(0.01)
    assert shift[("Q4_K_M",)]["p50_abs_shift"] == pytest.approx(0.2)
    assert shift[("(all)",)]["positions"] == 80


def test_flip_rate_binned_by_the_recompute_margin(client):
    flips = _by(client, "flip_rate_by_margin", ("weight_format", "margin_bin"), run_prefix="exp-")
    tie = flips[("F16", "[0,0.1)")]
    assert (tie["positions"], tie["flips"]) == (20, 4)
    assert (tie["ci_low"], tie["ci_high"]) == pytest.approx(wilson(4, 20))
    assert (flips[("F16", "[0.3,1)")]["positions"], flips[("F16", "[0.3,1)")]["flips"]) == (20, 0)
    assert (flips[("F16", ">=1")]["positions"], flips[("F16", ">=1")]["flips"]) == (36, 0)
    assert ("F16", "[0.1,0.3)") not in flips
    assert flips[("(all)", "[0,0.1)")]["positions"] == 21  # plus the Q4_K_M position


def test_margin_shift_and_flip_rate_compare_the_same_positions(client):
    shift = _by(client, "margin_shift", ("weight_format",), run_prefix="q8-")[("Q8_0",)]
    flips = _by(client, "flip_rate_by_margin", ("weight_format", "margin_bin"), run_prefix="q8-")
    # Both hits are paired with their recompute; only the one with margins has positions to compare.
    assert (shift["request_pairs"], shift["positions"]) == (2, len(SECOND))
    assert sum(row["positions"] for (fmt, _), row in flips.items() if fmt == "Q8_0") == shift["positions"]
