"""A production server traces with the default capture, ``hashed``.  Whoever can read the trace
store must not be able to count token hashes and read the conversations off their frequencies: a
token gets a new hash in every place — every position of every prompt — and only the same token in
the same place of two requests with the same prompt hashes alike.  That is exactly where kvtrace
compares tokens, so ``kvtrace diff``, its labels and the margin-shift and flip analyses find with
hashed ids what they find with ids in the clear."""

from __future__ import annotations

import json
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
from receivers import Loopback


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


# --- what the store holds, read as someone without the key reads it -------------------------------
# (before the module-scoped database below: chDB opens one database per process)

SECRET = "the patient's name is Alice Liddell"
"""Text a client wrote: an upstream's error message that repeats it, a stop string."""


def everything_stored(client) -> str:
    """Every row of every table of the database, as text: what a reader of the store sees."""
    tables = [name for (name,) in client.query(
        "SELECT name FROM system.tables WHERE database = currentDatabase() AND engine NOT LIKE '%View'").result_rows]
    assert {"otel_traces", "kvtrace_requests", "kvtrace_cache_events"} <= set(tables)
    return "\n".join(repr(row) for table in tables for row in client.query(f"SELECT * FROM {table}").result_rows)


def record_requests(spool_dir, capture: str, requests) -> Recorder:
    """Each of ``requests`` (prompt, output, error detail, stop strings) as one request of run `prod`."""
    import os

    os.environ["KVTRACE_CAPTURE"] = capture
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    for i, (prompt, output, detail, stop) in enumerate(requests):
        with correlate(run_id="prod", episode_id=f"conversation-{i}", turn=0):
            record = recorder.start_request("llama_cpp", model="m")
        record.prompt_token_ids, record.prompt_tokens = list(prompt), len(prompt)
        for token in output:
            record.add_token(token, token, token + 1, 1.0, -0.1)
        if detail:
            record.error, record.error_detail = "upstream HTTP 400", detail
        if stop is not None:
            record.config[sc.SAMPLING_SETTINGS] = {"temperature": 0.0, "stop": stop}
        recorder.finish(record)
    recorder.pipeline.force_flush()
    recorder.shutdown()
    return recorder


def stored_requests(db) -> list[tuple]:
    return db.query("SELECT prompt_hash, output_hash, token_ids FROM kvtrace_requests WHERE run_id = 'prod' "
                    "ORDER BY episode_id").result_rows


@pytest.mark.parametrize("capture", ["ids", "hashed", "none"])
def test_equal_outputs_of_different_prompts_do_not_hash_alike(spool_dir, db, capture):
    # One-token answers ("yes" = 7, "no" = 8) to 200 different questions: hashed alone, the output
    # hash would be a substitution cipher of the answers.
    rng = random.Random(3)
    requests = [([1, 100 + i, rng.randrange(50)], [rng.choice([7, 8])], None, None) for i in range(200)]
    record_requests(spool_dir, capture, requests)
    ingest_paths(db, [spool_dir])
    rows = stored_requests(db)
    assert len(rows) == 200 and len({prompt for prompt, _, _ in rows}) == 200
    assert len({output for _, output, _ in rows}) == 200  # two answers, two hundred hashes
    if capture == "none":
        assert all(list(ids) == [] for _, _, ids in rows)  # no per-token ids at all


def test_equal_outputs_of_one_prompt_still_hash_alike(spool_dir, db):
    prompt = [1, 2, 3]
    record_requests(spool_dir, "hashed", [(prompt, [7, 8], None, None), (prompt, [7, 8], None, None),
                                          (prompt, [7, 9], None, None)])
    ingest_paths(db, [spool_dir])
    (p0, o0, t0), (p1, o1, t1), (p2, o2, t2) = stored_requests(db)
    assert p0 == p1 == p2 and len(p0) == 32  # a 128-bit prompt hash: the place of every token under it
    assert o0 == o1 != o2 and list(t0) == list(t1) and t0[0] == t2[0] and t0[1] != t2[1]


@pytest.mark.parametrize("capture", ["hashed", "none"])
def test_an_upstream_error_that_repeats_the_input_and_stop_strings_are_not_stored_in_the_clear(spool_dir, db,
                                                                                              capture):
    requests = [([1, 2, 3], [7], f"invalid request: {SECRET!r} is too long", None),
                ([1, 2, 4], [7], None, [SECRET, "\n"]),
                ([1, 2, 4], [7], None, [SECRET, "\n"]),
                ([1, 2, 5], [7], None, [SECRET, "\n"])]
    record_requests(spool_dir, capture, requests)
    ingest_paths(db, [spool_dir])
    stored = everything_stored(db)
    assert "Alice" not in stored and "too long" not in stored
    status, = db.query("SELECT StatusMessage FROM otel_traces WHERE StatusMessage != ''").result_rows[0]
    settings = [s for (s,) in db.query("SELECT sampling_settings FROM kvtrace_requests WHERE sampling_settings != '' "
                                       "ORDER BY prompt_hash").result_rows]
    assert len(settings) == 3 and all(json.loads(s)["temperature"] == 0.0 for s in settings)
    if capture == "none":
        assert status == "upstream HTTP 400 (message not captured)"
        assert all("stop" not in json.loads(s) for s in settings)
    else:
        assert status.startswith("upstream HTTP 400 (message keyed-hashed: ")
        stops = [json.loads(s)["stop"] for s in settings]
        # Keyed under the prompt like a token: equal only where the prompt is the same.
        assert len(set(stops)) == 2 and sorted(stops.count(s) for s in set(stops)) == [1, 2]


def refusing_upstream() -> Loopback:
    """An OpenAI-compatible server that answers every completion 400 with an error message that repeats
    the client's prompt, as servers do."""

    def answer(method: str, path: str, body: bytes):
        if method != "POST":
            return 404, {}, b'{"error": {"message": "not found"}}'
        message = f"prompt {json.loads(body)['prompt']!r} is too long"
        return 400, {"Content-Type": "application/json"}, json.dumps({"error": {"message": message}}).encode()

    return Loopback(answer)


def test_a_proxied_upstreams_error_that_repeats_the_prompt_is_not_stored_in_the_clear(spool_dir, db, monkeypatch):
    import httpx

    from kvtrace.proxy.app import proxy_in_thread

    monkeypatch.setenv("KVTRACE_CAPTURE", "hashed")
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    upstream = refusing_upstream()
    try:
        with proxy_in_thread(upstream.url, recorder) as proxy:
            answer = httpx.post(proxy + "/v1/completions", json={"prompt": SECRET, "max_tokens": 3}, timeout=60)
    finally:
        upstream.close()
    assert answer.status_code == 400 and "Alice" in answer.text  # the client gets the upstream's answer
    recorder.pipeline.force_flush()
    recorder.shutdown()
    ingest_paths(db, [spool_dir])
    assert "Alice" not in everything_stored(db)
    status, = db.query("SELECT StatusMessage FROM otel_traces WHERE StatusMessage != ''").result_rows[0]
    assert status.startswith("upstream HTTP 400 (message keyed-hashed: ")


def test_with_ids_capture_the_operator_reads_the_upstreams_words(spool_dir, db):
    record_requests(spool_dir, "ids", [([1, 2, 3], [7], "context length exceeded", ["\n"])])
    ingest_paths(db, [spool_dir])
    status, = db.query("SELECT StatusMessage FROM otel_traces WHERE StatusMessage != ''").result_rows[0]
    assert status == "upstream HTTP 400: context length exceeded"
    assert json.loads(db.query("SELECT sampling_settings FROM kvtrace_requests").result_rows[0][0])["stop"] == ["\n"]


def test_a_guessed_prompt_cannot_be_confirmed_without_the_key(spool_dir, db):
    import hashlib
    import struct

    from kvtrace.recording.capture import CapturePolicy

    prompt = [1, 15043, 29892, 590, 1024, 338]
    record_requests(spool_dir, "hashed", [(prompt, [7], None, None)])
    ingest_paths(db, [spool_dir])
    stored_prompt, stored_output, _ = stored_requests(db)[0]
    packed = struct.pack(f"<{len(prompt)}q", *prompt)
    guesses = {hashlib.blake2b(packed, digest_size=16).hexdigest(), hashlib.sha256(packed).hexdigest()[:32],
               CapturePolicy("hashed", b"").hash_tokens(prompt),
               CapturePolicy("hashed", b"a-guessed-deployment-key").hash_tokens(prompt)}
    assert stored_prompt not in guesses
    # Whoever holds the key does confirm it: the hash is of this prompt, not of nothing.
    assert CapturePolicy("hashed", Settings.from_env().hash_key).hash_tokens(prompt) == stored_prompt


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
