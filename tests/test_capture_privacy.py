"""A production server traces with the default capture, ``hashed``.  Whoever can read the trace
store must not be able to count token hashes and read the conversations off their frequencies: a
token gets a new hash in every place — every position of every prompt — and only the same token in
the same place of two requests with the same prompt hashes alike.  That is exactly where kvtrace
compares tokens, so ``kvtrace diff``, its labels and the margin-shift and flip analyses find with
hashed ids what they find with ids in the clear."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from diff_scenarios import PROMPT, ScenarioBook, comparable, fork_summary, record_fork_scenarios
from kvtrace import correlate, queries
from kvtrace import semconv as sc
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.config import Settings
from kvtrace.analysis.forks import diff_runs
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.exporters.spool import SpoolExporter


def test_the_same_token_never_gets_the_same_hash_twice_across_prompts(spool_dir, db, monkeypatch):
    monkeypatch.setenv("KVTRACE_CAPTURE", "hashed")
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    rng = random.Random(5)
    vocabulary = range(3, 23)  # 20 tokens over 400 requests x 16 positions: each occurs ~600 times
    prompts: set[tuple[int, ...]] = set()
    truth = {}  # span id -> [(chosen, top1, runner-up)] per position
    while len(prompts) < 400:
        prompt = tuple([1] + [rng.choice(vocabulary) for _ in range(10)])
        if prompt in prompts:
            continue
        prompts.add(prompt)
        with correlate(run_id="prod", episode_id=f"conversation-{len(prompts)}", turn=0):
            record = recorder.start_request("llama_cpp", model="m")
        record.prompt_token_ids, record.prompt_tokens = list(prompt), len(prompt)
        for _ in range(16):
            chosen, runner_up = rng.sample(vocabulary, 2)
            record.add_token(chosen, chosen, runner_up, rng.random(), -rng.random())
        truth[record.span_id] = list(zip(record.output_token_ids, record.top1_ids, record.runner_up_ids))
        recorder.finish(record)
    recorder.pipeline.force_flush()
    recorder.shutdown()
    ingest_paths(db, [spool_dir])

    rows = db.query("SELECT SpanId, position, token_id, top1_id, runner_up_id FROM kvtrace_tokens "
                    "WHERE run_id = 'prod'").result_rows
    assert len(rows) == 400 * 16
    hashes_of = defaultdict(list)  # token id -> its hash in every place it occurred
    for span_id, position, token, top1, runner_up in rows:
        chosen_id, top1_id, runner_up_id = truth[span_id][position]
        assert token == top1  # chosen = top-1 in this place: still equal (the flip analysis needs it)
        hashes_of[chosen_id].append(token)
        hashes_of[runner_up_id].append(runner_up)
    assert set(hashes_of) == set(vocabulary)
    for token, hashes in hashes_of.items():
        assert len(set(hashes)) == len(hashes), f"token {token} got the same hash in two places"
        assert token not in hashes
    prompt_ids = db.query(f"SELECT countIf(mapContains(SpanAttributes, '{sc.PROMPT_TOKEN_IDS}')) "
                          "FROM otel_traces").result_rows[0][0]
    assert prompt_ids == 0  # a prompt's tokens, hashed under the prompt itself, would say nothing more


def test_positions_keep_their_hash_whatever_the_output_length(monkeypatch):
    from kvtrace.recording.capture import CapturePolicy

    policy = CapturePolicy("hashed", b"deployment key")
    prompt = policy.hash_tokens(PROMPT)
    short = policy.output_token_ids(prompt, [7, 8], [7, 8], [9, 9])
    long = policy.output_token_ids(prompt, [7, 8, 7, 8, 7], [7, 8, 7, 8, 7], [9, 9, 9, 9, 9])
    assert long.chosen[:2] == short.chosen and long.runner_up[:2] == short.runner_up  # a prefix stays a prefix
    assert len(set(long.chosen)) == 5
    # No prompt hash to place the tokens: none leave (outputs then compare by output hash).
    assert policy.output_token_ids("", [7], [7], [9]) is None


@pytest.fixture(scope="module")
def both_captures(tmp_path_factory):
    """The same two runs recorded twice, with ids in the clear (runs ids-*) and hashed (hashed-*)."""
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("privacy")
    books = {capture: ScenarioBook(root / f"spool-{capture}", capture=capture) for capture in ("ids", "hashed")}
    for capture, book in books.items():
        run_a, run_b = f"{capture}-A", f"{capture}-B"
        record_fork_scenarios(book, run_a, run_b)
        # The prompts differ and so do the outputs: a fork upstream, with no token position.
        book.turn(run_a, "rewritten", 0, PROMPT + [70], [71, 72, 73])
        book.turn(run_b, "rewritten", 0, PROMPT + [77], [71, 75, 73])
    client = connect(f"chdb://{root / 'db'}")
    init_schema(client)
    for book in books.values():
        book.ingest(client)
    yield client
    client.close()


def test_diff_finds_the_same_forks_with_hashed_ids_as_with_ids_in_the_clear(both_captures):
    client = both_captures
    clear, hashed = diff_runs(client, "ids-A", "ids-B"), diff_runs(client, "hashed-A", "hashed-B")
    assert {f.attribution for f in clear.forks} == {"hit_vs_recompute", "reuse_length", "cache_source",
                                                    "same_cache_path", "prompt_mismatch"}
    assert fork_summary(hashed) == fork_summary(clear)
    assert hashed.unforked == clear.unforked and hashed.compared_by == clear.compared_by == "token_ids"
    assert {f.episode: f.position for f in hashed.forks if f.kind == "prompt"} == {"rewritten": -1, "upstream": -1}
    hit = next(f for f in hashed.forks if f.episode == "hit")
    clear_hit = next(f for f in clear.forks if f.episode == "hit")
    assert (clear_hit.a.token, clear_hit.b.token) == (32, 40)
    assert hit.a.token not in (32, 40) and hit.a.token != hit.b.token  # hashed, still telling the sides apart


# divergence_rates is not among them: it compares arms, or repeats that served the episodes in the
# same order, and these scenario runs are neither (one arm, different cache paths per episode).
@pytest.mark.parametrize("query", ["margin_shift", "flip_rate_by_margin", "near_tie_share"])
def test_margin_flip_and_rate_analyses_agree_across_capture_modes(both_captures, query):
    _, clear = queries.run(both_captures, query, {"run_prefix": "ids-"})
    _, hashed = queries.run(both_captures, query, {"run_prefix": "hashed-"})
    assert clear, f"{query} has something to say about these runs"
    assert [comparable(row) for row in hashed] == [comparable(row) for row in clear]
