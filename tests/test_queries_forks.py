"""Two runs of the same episodes fork in every way kvtrace distinguishes; the saved queries
``forks`` and ``fork_attribution`` must find each fork where a plain Python comparison of the
recorded tokens finds it, label it, and name the cache event (and the request that stored the
restored state) that caused it."""

from __future__ import annotations

import math

import pytest

from diff_scenarios import FIRST, NEXT_PROMPT, PROMPT, CachePath, ScenarioBook, python_fork, record_fork_scenarios
from kvtrace import queries
from kvtrace import semconv as sc

A, B = "attr-A", "attr-B"
FA, FB = "integrity-A", "integrity-B"
FZ = "integrity-zero"


def record_foreign_state_scenarios(book: ScenarioBook) -> None:
    """Forks after a state that failed its integrity check: labelled foreign_state before any cache label."""
    from kvtrace.recording.records import CacheEvent

    for run in (FA, FB):
        book.turn(run, "other", 0, [90, 91, 92, 93], [94])
        book.turn(run, "fs", 0, PROMPT, FIRST)
        book.turn(run, "both", 0, PROMPT, FIRST)
    foreign = book.records[(FB, "other", 0)].origin()

    def violation(tokens: int) -> CacheEvent:
        return CacheEvent(sc.EVENT_CACHE_INTEGRITY_VIOLATION, sc.LAYER_PROMPT_CACHE, key_hash="key-own", tokens=tokens,
                          prefix_tokens=1, reason=sc.INTEGRITY_TOKENS_DIFFER, source=foreign)

    # fs: A recomputes; B restores what the cache called its own state, another episode's: a near tie flips.
    restore = CachePath(sc.LAYER_PROMPT_CACHE, 11, "key-own", book.records[(FB, "fs", 0)].origin(),
                        sc.EVENT_CACHE_RESTORE)
    book.turn(FA, "fs", 1, NEXT_PROMPT, [60, 61, 62], [1.0, 0.01, 1.0])
    book.turn(FB, "fs", 1, NEXT_PROMPT, [60, 63, 62], [1.0, 0.02, 1.0], cache=restore, events=[violation(11)])
    # both: the same cache path on both sides, but A's reused state was not its prompt's.
    reuse = CachePath(sc.LAYER_KV_REUSE, 11)
    book.turn(FA, "both", 1, NEXT_PROMPT, [70, 71], [0.5, 1.0], cache=reuse, events=[violation(11)])
    book.turn(FB, "both", 1, NEXT_PROMPT, [72, 71], [0.5, 1.0], cache=reuse)
    # zero: the server said nothing was cached, but the state it used was another prompt's (llama.cpp
    # #27148's sign: cached_tokens 0 on a restored conversation).
    book.turn(FZ, "zero", 0, PROMPT, FIRST)
    book.turn(FZ, "zero", 1, NEXT_PROMPT, [60, 61, 62], [1.0, 0.01, 1.0], events=[violation(11)])


def _rows(client, name, **params):
    columns, rows = queries.run(client, name, params)
    return {row[0]: dict(zip(columns, row)) for row in rows}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("forks")
    book = ScenarioBook(root / "spool")

    record_fork_scenarios(book, A, B)
    record_foreign_state_scenarios(book)

    # Runs recorded without token ids: outputs can only be compared by hash.
    hashed = ScenarioBook(root / "spool-none", capture="none")
    hashed.turn("none-A", "h", 0, PROMPT, [1, 2, 3])
    hashed.turn("none-B", "h", 0, PROMPT, [1, 9, 3])

    client = connect(f"chdb://{root / 'db'}")
    init_schema(client)
    book.ingest(client)
    hashed.ingest(client)
    yield client, book
    client.close()


def test_forks_match_a_plain_comparison_of_the_recorded_tokens(recorded):
    client, book = recorded
    forks = _rows(client, "forks", run_a=A, run_b=B)
    episodes = {e for (run, e, _) in book.records if run == A} - {"lonely"}
    assert set(forks) == episodes
    for episode, row in forks.items():
        expected = python_fork(book, A, B, episode)
        if expected is None:
            assert (row["forked"], row["fork_turn"], row["position"]) == (0, -1, -1), episode
        else:
            assert row["forked"] == 1
            assert (row["fork_turn"], row["position"], row["fork_kind"]) == expected, episode
            assert row["compared_by"] == "token_ids"


def test_fork_rows_name_both_spans_and_the_tokens_each_side_chose(recorded):
    client, book = recorded
    row = _rows(client, "forks", run_a=A, run_b=B)["hit"]
    assert (row["span_id_a"], row["span_id_b"]) == (book.records[(A, "hit", 1)].span_id,
                                                    book.records[(B, "hit", 1)].span_id)
    assert (row["token_a"], row["token_b"]) == (32, 40)
    prefix = _rows(client, "forks", run_a=A, run_b=B)["prefix"]
    assert (prefix["position"], prefix["token_a"], prefix["token_b"]) == (3, -1, 4)


def test_each_fork_gets_the_most_specific_label(recorded):
    client, _ = recorded
    labels = {e: r["attribution"] for e, r in _rows(client, "fork_attribution", run_a=A, run_b=B).items()}
    assert labels == {
        "hit": "hit_vs_recompute",
        "len": "reuse_length",
        "src": "cache_source",
        "same": "same_cache_path",
        "upstream": "prompt_mismatch",
        "prefix": "same_cache_path",
    }


def test_a_fork_after_foreign_state_is_labelled_so_before_any_cache_label(recorded):
    client, book = recorded
    rows = _rows(client, "fork_attribution", run_a=FA, run_b=FB)
    assert {e: r["attribution"] for e, r in rows.items()} == {"fs": "foreign_state", "both": "foreign_state"}
    fs = rows["fs"]
    stored_by = book.records[(FB, "other", 0)]
    assert (fs["culprit_side"], fs["culprit_span_id"]) == ("b", book.records[(FB, "fs", 1)].span_id)
    assert (fs["culprit_event"], fs["culprit_layer"], fs["culprit_key_hash"]) == (
        sc.EVENT_CACHE_INTEGRITY_VIOLATION, sc.LAYER_PROMPT_CACHE, "key-own")
    assert (fs["culprit_source_episode_id"], fs["culprit_source_span_id"]) == ("other", stored_by.span_id)
    assert fs["near_tie"] == 1 and "not its prompt's prefix" in fs["note"]
    assert (rows["both"]["culprit_side"], rows["both"]["culprit_run"]) == ("a", FA)


def test_the_alert_metric_counts_a_violation_on_a_request_that_reported_no_reuse(recorded):
    client, book = recorded
    columns, rows = queries.run(client, "integrity_violation_counts", {"run_prefix": FZ})
    (row,) = [dict(zip(columns, r)) for r in rows]
    assert (row["requests"], row["violations"]) == (1, 1)  # the violated request; turn 0 reused nothing
    columns, rows = queries.run(client, "integrity_violation_counts", {"run_prefix": FB})
    (row,) = [dict(zip(columns, r)) for r in rows]
    assert (row["requests"], row["violations"]) == (2, 1)  # requests: those that reused or met a violation


def test_hit_versus_recompute_blames_the_reuse_event_with_margins_and_near_tie(recorded):
    client, book = recorded
    row = _rows(client, "fork_attribution", run_a=A, run_b=B)["hit"]
    hit = book.records[(A, "hit", 1)]
    assert (row["culprit_side"], row["culprit_run"], row["culprit_span_id"]) == ("a", A, hit.span_id)
    assert (row["culprit_event"], row["culprit_event_index"], row["culprit_layer"]) == (
        sc.EVENT_CACHE_REUSE, 0, sc.LAYER_KV_REUSE)
    assert row["culprit_reused_tokens"] == 11
    assert row["culprit_block_hashes"] == ["bh-1", "bh-2"]
    assert (row["layer_a"], row["reused_tokens_a"], row["layer_b"], row["reused_tokens_b"]) == (
        sc.LAYER_KV_REUSE, 11, sc.LAYER_NONE, 0)
    assert (row["margin_a"], row["margin_b"]) == (0.02, 0.03)
    assert (row["token_a"], row["token_b"], row["runner_up_a"]) == (32, 40, 33)
    assert row["near_tie"] == 1
    assert row["margin_share"] <= 0.1  # one of the smallest margins of both runs


def test_near_tie_threshold_is_a_parameter(recorded):
    client, _ = recorded
    default = _rows(client, "fork_attribution", run_a=A, run_b=B)
    assert default["len"]["near_tie"] == 0  # margins 0.2 / 0.25
    wide = _rows(client, "fork_attribution", run_a=A, run_b=B, near_tie=0.3)
    assert wide["len"]["near_tie"] == 1
    assert wide["len"]["culprit_side"] == "a"  # the side that reused more


def test_cache_source_names_the_request_that_stored_the_restored_state(recorded):
    client, book = recorded
    row = _rows(client, "fork_attribution", run_a=A, run_b=B)["src"]
    stored_by = book.records[(B, "hit", 0)]
    assert row["culprit_run"] == B
    assert row["culprit_event"] == sc.EVENT_CACHE_RESTORE
    assert row["culprit_key_hash"] == "key-b"
    assert (row["culprit_source_request_id"], row["culprit_source_run_id"], row["culprit_source_episode_id"],
            row["culprit_source_turn"], row["culprit_source_span_id"]) == (
        stored_by.correlation.request_id, B, "hit", 0, stored_by.span_id)
    assert (row["source_episode_id_a"], row["source_turn_a"]) == ("src", 0)


def test_forks_not_explained_by_caching_have_no_culprit(recorded):
    client, _ = recorded
    rows = _rows(client, "fork_attribution", run_a=A, run_b=B)
    for episode in ("same", "upstream"):
        assert rows[episode]["culprit_span_id"] == "" and rows[episode]["culprit_event"] == ""
    assert "upstream" in rows["upstream"]["note"] and rows["upstream"]["fork_kind"] == "prompt"


def test_one_episode_only(recorded):
    client, _ = recorded
    assert list(_rows(client, "forks", run_a=A, run_b=B, episode="src")) == ["src"]
    assert list(_rows(client, "fork_attribution", run_a=A, run_b=B, episode="calm")) == []


def test_without_token_ids_outputs_are_compared_by_hash(recorded):
    client, _ = recorded
    row = _rows(client, "forks", run_a="none-A", run_b="none-B")["h"]
    assert (row["forked"], row["fork_turn"], row["position"], row["compared_by"]) == (1, 0, -1, "output_hash")
    attributed = _rows(client, "fork_attribution", run_a="none-A", run_b="none-B")["h"]
    assert attributed["attribution"] == "same_cache_path"
    assert math.isnan(attributed["margin_a"]) and attributed["near_tie"] == 0


def test_timeline_lists_both_runs_turns_with_their_cache_events(recorded):
    client, book = recorded
    columns, rows = queries.run(client, "episode_timeline", {"run_a": A, "run_b": B, "episode": "src"})
    turns = [dict(zip(columns, r)) for r in rows]
    assert [(t["side"], t["turn"]) for t in turns] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert turns[3]["event_names"] == [sc.EVENT_CACHE_RESTORE]
    assert turns[3]["token_ids"] == book.records[(B, "src", 1)].output_token_ids
