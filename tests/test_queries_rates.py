"""Rates count episodes, not runs. An experiment repeats passes of a cache-off arm and a cache arm over
ten episodes; the cache arm forks four of them. Whether that experiment ran each pass once or three
times, the saved rate queries must report the same n and the same interval, because bit-identical
repeats are one observation. Only real differences add samples: an episode order that changes an
episode's outcome (a second sample in that episode: the interval becomes a cluster bootstrap over
episodes), or a rerun that disagrees with itself (reported as repeats that differ). The flip rate by
margin counts each distinct position once, and margin shift and flip rate compare the same positions.
"""

from __future__ import annotations

import math

import pytest

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import queries
from kvtrace import semconv as sc

EPISODES = 10
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
FIRST = [10, 11, 12]
NEXT = PROMPT + FIRST + [20]
SECOND = [30, 31, 32, 33]
OFF_MARGINS = [1.0, 0.5, 0.04, 2.0]
FORKED_OUTPUT, FORKED_MARGINS = [30, 31, 99, 98], [1.01, 0.51, 0.03, 1.5]
FORKED = {0, 1, 2, 3}  # the episodes the cache arm forks
REUSE = CachePath(sc.LAYER_KV_REUSE, 8, event=sc.EVENT_CACHE_REUSE)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def record_pass(book: ScenarioBook, run: str, arm: str, forked=frozenset(), order=range(EPISODES),
                weight_format: str = "F16", cancelled=frozenset()) -> None:
    """One pass over the episodes in ``order``: turn 0 recomputed, turn 1 served from cache unless the
    arm is `off`; the episodes in ``forked`` choose another token at position 2 (a near tie); in the
    episodes in ``cancelled`` the client went away after turn 1's first two tokens."""
    for e in order:
        book.turn(run, f"e{e}", 0, PROMPT + [e], FIRST, arm=arm, weight_format=weight_format)
        if e in cancelled:
            book.turn(run, f"e{e}", 1, NEXT + [e], SECOND[:2], OFF_MARGINS[:2], cache=REUSE, arm=arm,
                      weight_format=weight_format, finish_reason=sc.FINISH_CANCELLED)
        elif arm == "off":
            book.turn(run, f"e{e}", 1, NEXT + [e], SECOND, OFF_MARGINS, arm=arm, weight_format=weight_format)
        elif e in forked:
            book.turn(run, f"e{e}", 1, NEXT + [e], FORKED_OUTPUT, FORKED_MARGINS, cache=REUSE, arm=arm,
                      weight_format=weight_format)
        else:
            book.turn(run, f"e{e}", 1, NEXT + [e], SECOND, [m + 0.01 for m in OFF_MARGINS], cache=REUSE, arm=arm,
                      weight_format=weight_format)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("rates")
    book = ScenarioBook(root / "spool")
    # The same experiment run once and three times: every repeat bit-identical.
    for prefix, repeats in (("once/", 1), ("thrice/", 3)):
        for r in range(repeats):
            record_pass(book, f"{prefix}off/r{r}", "off")
        for r in range(repeats):
            record_pass(book, f"{prefix}reuse/r{r}", "reuse", FORKED)
    # Two episode orders, once and twice each; the shuffled order also forks episode 5 (served first).
    shuffled = [5, 9, 8, 7, 6, 4, 3, 2, 1, 0]
    for prefix, repeats in (("orders/", 1), ("orders-twice/", 2)):
        for r in range(repeats):
            record_pass(book, f"{prefix}off/canonical/r{r}", "off")
            record_pass(book, f"{prefix}off/shuffled/r{r}", "off", order=shuffled)
            record_pass(book, f"{prefix}prompt-cache/canonical/r{r}", "prompt-cache", FORKED)
            record_pass(book, f"{prefix}prompt-cache/shuffled/r{r}", "prompt-cache", FORKED | {5}, order=shuffled)
    # The cache arm once more, with episode 6's turn 1 cut short by its client: an output that ended early.
    record_pass(book, "cancelled/off/r0", "off")
    record_pass(book, "cancelled/reuse/r0", "reuse", FORKED, cancelled={6})
    # A rerun that disagrees with its first pass on episode 9: nondeterminism outside the cache.
    record_pass(book, "noisy/off/r0", "off")
    record_pass(book, "noisy/reuse/r0", "reuse", FORKED)
    record_pass(book, "noisy/reuse/r1", "reuse", FORKED | {9})
    # Another configuration: a quantized format, one episode, a larger shift; and two cache hits of a
    # third, one with token ids but no margins (an engine path that ships no per-token statistics).
    book.turn("q4/off", "q", 0, PROMPT, SECOND, OFF_MARGINS, arm="off", weight_format="Q4_K_M")
    book.turn("q4/reuse", "q", 0, PROMPT, SECOND, [m + 0.2 for m in OFF_MARGINS], cache=REUSE, arm="reuse",
              weight_format="Q4_K_M")
    for episode, hit_margins in (("with-margins", OFF_MARGINS), ("ids-only", [])):
        book.turn("q8/off", episode, 0, PROMPT + [len(hit_margins)], SECOND, OFF_MARGINS, arm="off",
                  weight_format="Q8_0")
        book.turn("q8/reuse", episode, 0, PROMPT + [len(hit_margins)], SECOND, hit_margins, cache=REUSE,
                  arm="reuse", weight_format="Q8_0")
    connection = connect(f"chdb://{root / 'db'}")
    init_schema(connection)
    book.ingest(connection)
    yield connection
    connection.close()


def rows(client, name, **params) -> list[dict]:
    columns, found = queries.run(client, name, params)
    return [dict(zip(columns, row)) for row in found]


def against_off(client, prefix: str) -> dict[str, dict]:
    return {r["arm"]: r for r in rows(client, "divergence_rates", run_prefix=prefix, baseline_arm="off")}


def repeats(client, prefix: str) -> dict[str, dict]:
    return {r["arm"]: r for r in rows(client, "divergence_rates", run_prefix=prefix)}


STATISTICS = ("episodes_compared", "samples", "episodes_forked", "fork_rate", "ci_low", "ci_high", "interval_method",
              "median_fork_turn", "median_fork_position")


def test_an_arm_against_off_counts_each_episode_once(client):
    reuse = against_off(client, "once/")["reuse"]
    assert (reuse["compared_with"], reuse["runs"], reuse["compared_runs"]) == ("off", 1, 1)
    assert (reuse["episodes_compared"], reuse["samples"], reuse["episodes_forked"]) == (10, 10, 4)
    assert reuse["fork_rate"] == pytest.approx(0.4)
    assert reuse["interval_method"] == sc.INTERVAL_WILSON
    assert (reuse["ci_low"], reuse["ci_high"]) == pytest.approx(wilson(4, 10))
    assert (reuse["median_fork_turn"], reuse["median_fork_position"]) == (1, 2)
    assert reuse["mean_cached_tokens"] == pytest.approx(4.0)  # 8 tokens on every second request


def test_a_request_its_client_cancelled_is_no_fork(client):
    # Its output is not the engine's whole answer: the turn is left out, the episode's other turns compared.
    once, cancelled = against_off(client, "once/")["reuse"], against_off(client, "cancelled/")["reuse"]
    assert (cancelled["episodes_compared"], cancelled["samples"], cancelled["episodes_forked"]) == (10, 10, 4)
    assert {k: cancelled[k] for k in STATISTICS} == {k: once[k] for k in STATISTICS}


def test_three_identical_repeats_give_the_same_n_and_interval_as_one(client):
    once, thrice = against_off(client, "once/")["reuse"], against_off(client, "thrice/")["reuse"]
    assert (thrice["runs"], thrice["compared_runs"]) == (3, 3)
    assert {k: thrice[k] for k in STATISTICS} == {k: once[k] for k in STATISTICS}


def test_identical_repeats_are_reported_as_identical(client):
    found = repeats(client, "thrice/")
    assert set(found) == {"off", "reuse"}
    for arm in ("off", "reuse"):
        assert (found[arm]["compared_with"], found[arm]["runs"]) == (arm, 3)
        assert (found[arm]["episodes_compared"], found[arm]["episodes_forked"]) == (10, 0)
    assert repeats(client, "once/") == {}  # one run per arm: nothing to compare


def test_repeats_that_differ_are_a_finding_of_their_own(client):
    noisy = repeats(client, "noisy/")["reuse"]
    assert (noisy["runs"], noisy["episodes_compared"], noisy["episodes_forked"]) == (2, 10, 1)
    assert (noisy["ci_low"], noisy["ci_high"]) == pytest.approx(wilson(1, 10))
    # Against off, episode 9 now has two distinct samples: one agrees with off, one forked.
    reuse = against_off(client, "noisy/")["reuse"]
    assert (reuse["episodes_compared"], reuse["samples"], reuse["episodes_forked"]) == (10, 11, 5)
    assert reuse["fork_rate"] == pytest.approx((4 + 0.5) / 10)
    assert reuse["interval_method"] == sc.INTERVAL_CLUSTER_BOOTSTRAP


def test_an_order_that_changes_an_episode_adds_a_sample_in_that_episode(client):
    cache = against_off(client, "orders/")["prompt-cache"]
    # Episodes 0-3 fork the same way in both orders (one sample each); episode 5 forks only when shuffled.
    assert (cache["runs"], cache["episodes_compared"], cache["samples"], cache["episodes_forked"]) == (2, 10, 11, 5)
    assert cache["fork_rate"] == pytest.approx(0.45)
    assert cache["interval_method"] == sc.INTERVAL_CLUSTER_BOOTSTRAP
    assert 0 < cache["ci_low"] < 0.45 < cache["ci_high"] < 1
    # Ten episodes with one clean yes/no each would give Wilson; the resampled interval is not that one.
    assert (cache["ci_low"], cache["ci_high"]) != pytest.approx(wilson(5, 10))
    twice = against_off(client, "orders-twice/")["prompt-cache"]
    assert twice["runs"] == 4
    assert {k: twice[k] for k in STATISTICS} == {k: cache[k] for k in STATISTICS}


def test_configurations_are_kept_apart_and_the_prefix_limits_the_runs(client):
    formats = {r["weight_format"]: r for r in rows(client, "divergence_rates", run_prefix="q", baseline_arm="off")}
    assert set(formats) == {"Q4_K_M", "Q8_0"}
    assert (formats["Q4_K_M"]["episodes_compared"], formats["Q4_K_M"]["episodes_forked"]) == (1, 0)
    everything = rows(client, "divergence_rates", run_prefix="", baseline_arm="off")
    f16 = [r for r in everything if r["weight_format"] == "F16" and r["arm"] == "reuse"]
    # once/, thrice/, cancelled/ and noisy/ share one configuration
    assert len(f16) == 1 and f16[0]["runs"] == 1 + 3 + 1 + 2


def test_flip_rate_counts_each_distinct_position_once(client):
    once = {r["margin_bin"]: r for r in rows(client, "flip_rate_by_margin", run_prefix="once/")
            if r["weight_format"] == "F16"}
    thrice = {r["margin_bin"]: r for r in rows(client, "flip_rate_by_margin", run_prefix="thrice/")
              if r["weight_format"] == "F16"}
    assert thrice == once
    tie = once["[0,0.1)"]  # position 2 of each of the 10 cache hits: 4 flipped
    assert (tie["episodes"], tie["positions"], tie["flips"]) == (10, 10, 4)
    assert tie["interval_method"] == sc.INTERVAL_WILSON  # one position per episode in this bin
    assert (tie["ci_low"], tie["ci_high"]) == pytest.approx(wilson(4, 10))
    # Margins >= 1: position 0 of every hit, position 3 of the six that did not fork; none flipped,
    # so no episode differs from another: nothing to resample, Wilson over the 16 positions.
    top = once[">=1"]
    assert (top["episodes"], top["positions"], top["flips"]) == (10, 16, 0)
    assert top["interval_method"] == sc.INTERVAL_WILSON
    assert (top["ci_low"], top["ci_high"]) == pytest.approx(wilson(0, 16))
    assert "[0.1,0.3)" not in once


def test_flip_rate_clusters_positions_by_episode(client):
    # The noisy reruns: episode 9's position 2 was hit twice, flipped once — one position, flipped.
    tie = {r["weight_format"]: r for r in rows(client, "flip_rate_by_margin", run_prefix="noisy/")
           if r["margin_bin"] == "[0,0.1)"}["F16"]
    assert (tie["positions"], tie["flips"]) == (10, 5)
    mid = {r["weight_format"]: r for r in rows(client, "flip_rate_by_margin", run_prefix="noisy/")
           if r["margin_bin"] == "[0.3,1)"}["F16"]
    assert (mid["episodes"], mid["positions"], mid["flips"]) == (10, 10, 0)


def test_margin_shift_at_matched_positions(client):
    shift = {r["weight_format"]: r for r in rows(client, "margin_shift", run_prefix="once/")}["F16"]
    # 6 unforked hits x 4 positions at +0.01; 4 forked hits x 3 positions (through the fork), last -0.01.
    assert (shift["request_pairs"], shift["positions"]) == (10, 36)
    assert shift["mean_shift"] == pytest.approx((32 * 0.01 - 4 * 0.01) / 36)
    assert shift["mean_abs_shift"] == pytest.approx(0.01)
    assert {r["weight_format"]: r for r in rows(client, "margin_shift", run_prefix="q4/")}["Q4_K_M"][
        "p50_abs_shift"] == pytest.approx(0.2)


def test_margin_shift_and_flip_rate_compare_the_same_positions(client):
    shift = {r["weight_format"]: r for r in rows(client, "margin_shift", run_prefix="q8/")}["Q8_0"]
    flips = [r for r in rows(client, "flip_rate_by_margin", run_prefix="q8/") if r["weight_format"] == "Q8_0"]
    # Both hits are paired with their recompute; only the one with margins has positions to compare.
    assert (shift["request_pairs"], shift["positions"]) == (2, len(SECOND))
    assert sum(row["positions"] for row in flips) == shift["positions"]
    once = {r["weight_format"]: r for r in rows(client, "margin_shift", run_prefix="once/")}["F16"]
    assert sum(r["positions"] for r in rows(client, "flip_rate_by_margin", run_prefix="once/")
               if r["weight_format"] == "F16") == once["positions"]


def test_margin_shift_counts_episodes_and_bootstraps_its_interval_over_them(client, tmp_path):
    """Two hits per episode, three episodes whose shifts differ: n is 3 episodes, not 6 pairs, and the
    interval of the mean |shift| comes from resampling episodes. One episode alone shows no spread."""
    book = ScenarioBook(tmp_path / "spool")
    cases = [("F16", f"e{e}", shift) for e, shift in enumerate((0.1, 0.2, 0.6))] + [("Q8_0", "q", 0.3)]
    for fmt, episode, shift in cases:
        for turn in (0, 1):
            prompt = PROMPT + [len(episode), turn, int(shift * 10)]
            book.turn("ci-off", episode, turn, prompt, SECOND, OFF_MARGINS, arm="off", weight_format=fmt)
            book.turn("ci-hit", episode, turn, prompt, SECOND, [m + shift for m in OFF_MARGINS], cache=REUSE,
                      weight_format=fmt)
    book.ingest(client)  # runs of their own ("ci-"): the module's database, one embedded database a process
    shift = {r["weight_format"]: r for r in rows(client, "margin_shift", run_prefix="ci-")}
    f16 = shift["F16"]
    assert (f16["request_pairs"], f16["episodes"], f16["positions"]) == (6, 3, 6 * len(SECOND))
    assert f16["mean_abs_shift"] == pytest.approx(0.3)
    assert 0.1 - 1e-9 <= f16["ci_low"] < 0.3 < f16["ci_high"] <= 0.6 + 1e-9
    assert (shift["Q8_0"]["episodes"], shift["Q8_0"]["ci_low"], shift["Q8_0"]["ci_high"]) == (
        1, pytest.approx(0.3), pytest.approx(0.3))
    assert shift["(all)"]["episodes"] == 4 and shift["(all)"]["shadow_pairs"] == 0
