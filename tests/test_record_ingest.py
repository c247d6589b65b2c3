"""Recorded spans travel record → spool → ingest → typed tables without losing a bit."""

from __future__ import annotations

import json
import struct

from opentelemetry import trace
from opentelemetry.propagate import extract

from kvtrace import correlate, semconv
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.recording.records import CacheEvent, StateOrigin


def _record(recorder, run_id, episode, turn, margins, reused=0, events=()):
    with correlate(run_id=run_id, episode_id=episode, turn=turn):
        rec = recorder.start_request("test_engine", model="tiny")
    rec.prompt_token_ids = list(range(100, 140))
    rec.prompt_tokens = 40
    rec.reused_tokens, rec.recomputed_tokens = reused, 40 - reused
    rec.cache_layer = semconv.LAYER_PROMPT_CACHE if reused else semconv.LAYER_NONE
    for i, m in enumerate(margins):
        rec.add_token(1000 + i, 1000 + i, 2000 + i, m, -m / 3)
    rec.events.extend(events)
    rec.config[semconv.MODEL_WEIGHT_FORMAT] = "Q4_K_M"
    rec.config[semconv.NUMERICS_SETTINGS] = {"n_threads": 1, "n_ubatch": 512}
    recorder.finish(rec)
    return rec


def test_tokens_margins_events_and_baggage_survive_bit_exact(spool_recorder, spool_dir, db):
    # Margins chosen to be awkward in decimal: subnormal-ish, tiny, huge, and a ULP apart.
    awkward = [5e-324, 1e-17, 0.1 + 0.2, 123456789.123456789, 1.0, struct.unpack("<d", struct.pack("<q", 0x3FF0000000000001))[0]]
    origin = StateOrigin(span_id="00000000000000ab", trace_id="0" * 31 + "1", request_id="req-7",
                         run_id="runA", episode_id="ep0", turn=1, time_unix_nano=1_700_000_000_000_000_000)
    restore = CacheEvent(semconv.EVENT_CACHE_RESTORE, semconv.LAYER_PROMPT_CACHE, key_hash="k1",
                         tokens=32, prefix_tokens=32, block_hashes=["h1", "h2"], source=origin)
    rec = _record(spool_recorder, "runA", "ep1", 3, awkward, reused=32, events=[restore])
    spool_recorder.pipeline.force_flush()

    report = ingest_paths(db, [spool_dir])
    assert report.spans == 1 and report.quarantined == 0

    row = db.query(
        "SELECT run_id, episode_id, turn, token_ids, margins, logprobs, reused_tokens, cache_layer, "
        "weight_format, numerics_settings, prompt_hash, SpanId FROM kvtrace_requests").result_rows
    assert len(row) == 1
    run_id, episode, turn, tokens, margins, logprobs, reused, layer, fmt, numerics, prompt_hash, span_id = row[0]
    assert (run_id, episode, turn) == ("runA", "ep1", 3)
    assert tokens == rec.output_token_ids
    assert [struct.pack("<d", m) for m in margins] == [struct.pack("<d", m) for m in awkward]
    assert logprobs == rec.logprobs
    assert (reused, layer, fmt) == (32, "prompt_cache", "Q4_K_M")
    assert json.loads(numerics) == {"n_threads": 1, "n_ubatch": 512}
    assert prompt_hash == spool_recorder.hash_tokens(list(range(100, 140)))
    assert span_id == rec.span_id

    token_rows = db.query("SELECT position, token_id, runner_up_id, margin FROM kvtrace_tokens ORDER BY position").result_rows
    assert [(p, t, r) for p, t, r, _ in token_rows] == [(i, 1000 + i, 2000 + i) for i in range(len(awkward))]
    assert [m for *_, m in token_rows] == awkward

    events = db.query("SELECT event, layer, key_hash, tokens, block_hashes, source_request_id, source_run_id, "
                      "source_episode_id, source_turn, source_span_id, source_time_unix_nano "
                      "FROM kvtrace_cache_events").result_rows
    assert events == [("kvtrace.cache.restore", "prompt_cache", "k1", 32, ["h1", "h2"], "req-7", "runA", "ep0", 1,
                       "00000000000000ab", 1_700_000_000_000_000_000)]


def test_requests_join_the_callers_trace_from_w3c_headers(spool_recorder, spool_dir, db):
    headers = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "baggage": "kvtrace.run_id=harness-run,kvtrace.episode_id=ep-9,kvtrace.turn=4",
    }
    from opentelemetry import context

    token = context.attach(extract(headers))
    try:
        rec = spool_recorder.start_request("test_engine")
    finally:
        context.detach(token)
    rec.add_token(1, 1, 2, 0.5, -0.1)
    spool_recorder.finish(rec)
    spool_recorder.pipeline.force_flush()
    ingest_paths(db, [spool_dir])
    rows = db.query("SELECT TraceId, ParentSpanId, run_id, episode_id, turn FROM kvtrace_requests").result_rows
    assert rows == [("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "harness-run", "ep-9", 4)]
    assert trace.get_current_span().get_span_context().is_valid is False


def test_ingesting_twice_or_a_copy_adds_nothing(spool_recorder, spool_dir, db, tmp_path):
    for turn in range(3):
        _record(spool_recorder, "runB", "ep1", turn, [0.5, 0.25])
    spool_recorder.pipeline.force_flush()
    assert ingest_paths(db, [spool_dir]).spans == 3
    assert ingest_paths(db, [spool_dir]).spans == 0
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for f in spool_dir.glob("*.jsonl"):
        (copy / ("renamed-" + f.name)).write_bytes(f.read_bytes())
    assert ingest_paths(db, [copy]).spans == 0
    assert db.query("SELECT count() FROM kvtrace_requests").result_rows[0][0] == 3


def test_hashed_capture_keeps_equality_where_tokens_are_compared_but_not_content(monkeypatch, spool_dir):
    from kvtrace.recording.capture import CapturePolicy

    a = CapturePolicy("hashed", b"key-1")
    b = CapturePolicy("hashed", b"key-1")
    other = CapturePolicy("hashed", b"key-2")
    prompt = a.hash_tokens([1, 2, 3])
    chosen, top1, runner_up = [5, 17, 5, 99], [5, 17, 5, 98], [6, 18, 7, 5]
    hashed = a.output_token_ids(prompt, chosen, top1, runner_up)
    assert hashed == b.output_token_ids(prompt, chosen, top1, runner_up)  # same key, same prompt: comparable
    assert hashed.chosen[:3] == hashed.top1[:3] and hashed.chosen[3] != hashed.top1[3]  # chosen vs top-1
    assert len({hashed.chosen[0], hashed.chosen[2], hashed.runner_up[3]}) == 3  # token 5 elsewhere: unlinkable
    assert not set(hashed.chosen) & set(chosen)                          # content not in the clear
    assert not set(a.output_token_ids(a.hash_tokens([1, 2, 4]), chosen, top1, runner_up).chosen) & set(hashed.chosen)
    assert other.output_token_ids(prompt, chosen, top1, runner_up) != hashed  # not recomputable without the key
    assert a.prompt_token_ids([1, 2, 3]) is None                         # prompt ids: with ids capture only
    assert CapturePolicy("none", b"k").output_token_ids(prompt, chosen, top1, runner_up) is None
    engine_hash = "9f" * 32  # e.g. a vLLM block hash: sha256 of the block's token ids
    assert CapturePolicy("ids", b"key-1").engine_hash(engine_hash) == engine_hash
    assert a.engine_hash(engine_hash) == b.engine_hash(engine_hash) != engine_hash
    assert other.engine_hash(engine_hash) != a.engine_hash(engine_hash)
    assert a.block_hashes(list(range(40)), 16)[:2] == b.block_hashes(list(range(33)), 16)[:2]
    assert len(a.block_hashes(list(range(40)), 16)) == 2
