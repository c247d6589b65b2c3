"""Forks on one cache path that the batching explains: `kvtrace diff` labels them batch_composition (after
every cache label, before same_cache_path), and flip_rate_by_batch_rows bins the flips by how differently
the two sides' steps were batched. Recorded spans, stored through ingest into the embedded database."""

from __future__ import annotations

import pytest

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import queries
from kvtrace import semconv as sc
from kvtrace.analysis.fork_text import describe_fork
from kvtrace.analysis.forks import diff_runs

A, B = "batched", "alone"
PROMPT = list(range(1, 13))
TOKENS = [40, 41, 42, 43]
FORKED = [40, 41, 99, 98]
REUSE = CachePath(sc.LAYER_KV_REUSE, 8, event=sc.EVENT_CACHE_REUSE)
ALONE = ([1, 1, 1, 1], [12, 1, 1, 1], [12])
"""step rows, step tokens, prefill steps of a request computed alone."""
BATCHED = ([3, 3, 2, 2], [36, 3, 2, 2], [12])
SPLIT = ([1, 1, 1, 1], [4, 1, 1, 1], [4, 4, 4])


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("batch")
    book = ScenarioBook(root / "spool")
    prompt = {e: PROMPT + [e] for e in range(6)}
    # e0: batched differently, forks at token 2 -> batch_composition
    book.turn(A, "e0", 0, prompt[0], TOKENS, batch=BATCHED)
    book.turn(B, "e0", 0, prompt[0], FORKED, [1.0, 1.0, 0.02, 1.0], batch=ALONE)
    # e1: the prompt split into other steps, every step of the tokens alike -> batch_composition
    book.turn(A, "e1", 0, prompt[1], TOKENS, batch=ALONE)
    book.turn(B, "e1", 0, prompt[1], FORKED, batch=SPLIT)
    # e2: batched differently but one side reused the cache: the cache label ranks first
    book.turn(A, "e2", 0, prompt[2], TOKENS, cache=REUSE, batch=BATCHED)
    book.turn(B, "e2", 0, prompt[2], FORKED, batch=ALONE)
    # e3: same steps on both sides -> same_cache_path
    book.turn(A, "e3", 0, prompt[3], TOKENS, batch=ALONE)
    book.turn(B, "e3", 0, prompt[3], FORKED, batch=ALONE)
    # e4: one side did not record its batching -> same_cache_path (nothing to tell them apart)
    book.turn(A, "e4", 0, prompt[4], TOKENS, batch=BATCHED)
    book.turn(B, "e4", 0, prompt[4], FORKED)
    # e5: batched differently, no fork
    book.turn(A, "e5", 0, prompt[5], TOKENS, batch=BATCHED)
    book.turn(B, "e5", 0, prompt[5], TOKENS, batch=ALONE)
    db = connect(f"chdb://{root / 'db'}")
    init_schema(db)
    book.ingest(db)
    yield db
    db.close()


def test_a_fork_on_one_cache_path_that_was_batched_differently_is_labelled_with_both_sides_steps(client):
    diff = diff_runs(client, A, B)
    labels = {f.episode: f.attribution for f in diff.forks}
    assert labels == {"e0": sc.ATTRIBUTION_BATCH_COMPOSITION, "e1": sc.ATTRIBUTION_BATCH_COMPOSITION,
                      "e2": sc.ATTRIBUTION_HIT_VS_RECOMPUTE, "e3": sc.ATTRIBUTION_SAME_CACHE_PATH,
                      "e4": sc.ATTRIBUTION_SAME_CACHE_PATH}
    assert diff.unforked == ["e5"]
    fork = next(f for f in diff.forks if f.episode == "e0")
    assert (fork.position, fork.a.batch.rows, fork.b.batch.rows, fork.a.batch.tokens, fork.b.batch.tokens) == (2, 2, 1, 2, 1)
    assert "2 vs 1 rows" in fork.note and fork.culprit is None
    split = next(f for f in diff.forks if f.episode == "e1")
    assert (split.a.batch.prefill_steps, split.b.batch.prefill_steps) == ([12], [4, 4, 4])
    assert "1 vs 3 steps" in split.note
    unrecorded = next(f for f in diff.forks if f.episode == "e4")
    assert unrecorded.a.batch is not None and unrecorded.b.batch is None


def test_diff_prints_both_sides_batches(client):
    (fork,) = diff_runs(client, A, B, episode="e0").forks
    text = describe_fork(fork)
    assert "[batch_composition]" in text
    assert ("batches: A fork token's step 2 rows, 2 tokens; prompt computed in 1 step(s) [12] | "
            "B fork token's step 1 rows, 1 tokens; prompt computed in 1 step(s) [12]") in text
    assert fork.note in text


def test_flip_rate_by_batch_rows_bins_each_compared_position_by_its_steps_rows_difference(client):
    columns, rows = queries.run(client, "flip_rate_by_batch_rows", {"run_a": A, "run_b": B})
    found = {r["rows_difference"]: r for r in (dict(zip(columns, row)) for row in rows)}
    # Pairs on one cache path, both recorded: e0 (positions 0-2, rows 3/1, 3/1, 2/1), e1 (split differs:
    # positions 0-2), e3 (rows equal: positions 0-2), e5 (rows 3/1 3/1 2/1 2/1, no flip). e2 (other cache
    # path) and e4 (not recorded) are left out.
    assert {k: (r["episodes"], r["positions"], r["flips"]) for k, r in found.items()} == {
        "0": (1, 3, 1), "1": (2, 3, 1), "2-3": (2, 4, 0), sc.BATCH_BIN_PREFILL_SPLIT: (1, 3, 1)}
    assert list(found) == ["0", "1", "2-3", sc.BATCH_BIN_PREFILL_SPLIT]
    assert found["1"]["flip_rate"] == pytest.approx(1 / 3)
