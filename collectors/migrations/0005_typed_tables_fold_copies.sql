-- Version 5: kvtrace's typed tables fold copies of a span into one (ReplacingMergeTree, sorted by run, then the
-- span's ids), so a span stored twice, by a retried write or by two paths, counts once in queries (they read
-- FINAL). An engine and a sort key cannot be altered in place: each table is built anew beside the old one
-- with version 5's definition (written out here: the current DDL may change later), the rows are copied, the
-- two are exchanged and the old one is dropped, in time proportional to the rows stored.
-- The views that write into these tables go first, so the old tables take no more rows while they are
-- copied and no view is left writing into a dropped table; the current DDL, run after the migrations,
-- creates them again. Version 4's Null table kvtrace_request_spans and its two views go as well: ingest
-- writes the typed tables itself. The table goes before its views (as in 0004): an ingest of version 4 still
-- running has its insert refused rather than its rows passing through a Null table no view reads.
-- Run again after an interruption, every step redoes its work from the old table or from the new one,
-- whichever holds the name by then; nothing is copied twice into one table.
-- otel_traces keeps its engine and gains a deduplication window: ingest names each insert with a token made
-- from the chunk it read, so a chunk read again after a stop is not stored twice.
-- On a cluster the *_local tables are rebuilt on every node and the Distributed tables in front, which name
-- them, read the new ones; the copy reads through the Distributed table and writes to every shard, each run
-- to one (copies of a span once stored on two shards meet there and fold).
DROP TABLE IF EXISTS ${database}.`kvtrace_request_spans` ${on_cluster};
DROP VIEW IF EXISTS ${database}.`kvtrace_request_spans_mv` ${on_cluster};
DROP VIEW IF EXISTS ${database}.`kvtrace_request_spans_otel_traces_mv` ${on_cluster};
DROP VIEW IF EXISTS ${database}.`kvtrace_requests_mv` ${on_cluster};
DROP VIEW IF EXISTS ${database}.`kvtrace_cache_events_mv` ${on_cluster};
DROP VIEW IF EXISTS ${database}.`kvtrace_tokens_mv` ${on_cluster};

-- kvtrace_requests
DROP TABLE IF EXISTS ${database}.${kvtrace_requests_rebuilt} ${on_cluster} SYNC;
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_requests_rebuilt} ${on_cluster} (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String,
    SpanId String,
    ParentSpanId String,
    ServiceName LowCardinality(String),
    run_id String,
    episode_id String,
    turn Int32,
    request_id String,
    operation LowCardinality(String),
    engine LowCardinality(String),
    engine_version LowCardinality(String),
    model String,
    model_fingerprint String,
    weight_format LowCardinality(String),
    kv_cache_type LowCardinality(String),
    arm LowCardinality(String),
    capture_mode LowCardinality(String),
    cache_settings String,
    numerics_settings String,
    sampling_settings String,
    prompt_tokens UInt32,
    prompt_hash String,
    prompt_hash_source LowCardinality(String),
    prompt_block_hashes Array(String),
    block_layers Array(LowCardinality(String)),
    cache_layer LowCardinality(String),
    reused_tokens UInt32,
    recomputed_tokens UInt32,
    replayed_tokens UInt32,
    reused_tokens_source LowCardinality(String),
    state_key String,
    source_span_id String,
    source_trace_id String,
    source_request_id String,
    source_run_id String,
    source_episode_id String,
    source_turn Int32,
    hit_block_hashes Array(String),
    output_tokens UInt32,
    output_hash String,
    token_id_source LowCardinality(String),
    token_ids Array(Int64),
    top1_ids Array(Int64),
    runner_up_ids Array(Int64),
    margins Array(Float64),
    logprobs Array(Float64),
    finish_reason LowCardinality(String),
    status_code LowCardinality(String),
    duration_ns UInt64
) ENGINE = ${span_engine}
PARTITION BY toDate(Timestamp)
ORDER BY (run_id, episode_id, turn, Timestamp, TraceId, SpanId);
INSERT INTO ${kvtrace_requests_rebuilt_copy} (
    Timestamp, TraceId, SpanId, ParentSpanId, ServiceName, run_id, episode_id, turn, request_id, operation,
    engine, engine_version, model, model_fingerprint, weight_format, kv_cache_type, arm, capture_mode,
    cache_settings, numerics_settings, sampling_settings, prompt_tokens, prompt_hash, prompt_hash_source,
    prompt_block_hashes, block_layers, cache_layer, reused_tokens, recomputed_tokens, replayed_tokens,
    reused_tokens_source, state_key, source_span_id, source_trace_id, source_request_id, source_run_id,
    source_episode_id, source_turn, hit_block_hashes, output_tokens, output_hash, token_id_source, token_ids,
    top1_ids, runner_up_ids, margins, logprobs, finish_reason, status_code, duration_ns)
SELECT
    Timestamp, TraceId, SpanId, ParentSpanId, ServiceName, run_id, episode_id, turn, request_id, operation,
    engine, engine_version, model, model_fingerprint, weight_format, kv_cache_type, arm, capture_mode,
    cache_settings, numerics_settings, sampling_settings, prompt_tokens, prompt_hash, prompt_hash_source,
    prompt_block_hashes, block_layers, cache_layer, reused_tokens, recomputed_tokens, replayed_tokens,
    reused_tokens_source, state_key, source_span_id, source_trace_id, source_request_id, source_run_id,
    source_episode_id, source_turn, hit_block_hashes, output_tokens, output_hash, token_id_source, token_ids,
    top1_ids, runner_up_ids, margins, logprobs, finish_reason, status_code, duration_ns
FROM ${database}.`kvtrace_requests`
SETTINGS insert_distributed_sync = 1;
EXCHANGE TABLES ${database}.${kvtrace_requests} AND ${database}.${kvtrace_requests_rebuilt} ${on_cluster};
DROP TABLE IF EXISTS ${database}.${kvtrace_requests_rebuilt} ${on_cluster} SYNC;

-- kvtrace_tokens
DROP TABLE IF EXISTS ${database}.${kvtrace_tokens_rebuilt} ${on_cluster} SYNC;
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_tokens_rebuilt} ${on_cluster} (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String,
    SpanId String,
    run_id String,
    episode_id String,
    turn Int32,
    request_id String,
    engine LowCardinality(String),
    weight_format LowCardinality(String),
    arm LowCardinality(String),
    prompt_hash String,
    cache_layer LowCardinality(String),
    reused_tokens UInt32,
    position UInt32,
    token_id Int64,
    top1_id Int64,
    runner_up_id Int64,
    margin Float64,
    logprob Float64
) ENGINE = ${span_engine}
PARTITION BY toDate(Timestamp)
ORDER BY (run_id, episode_id, turn, position, TraceId, SpanId);
INSERT INTO ${kvtrace_tokens_rebuilt_copy} (
    Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, weight_format, arm, prompt_hash,
    cache_layer, reused_tokens, position, token_id, top1_id, runner_up_id, margin, logprob)
SELECT
    Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, weight_format, arm, prompt_hash,
    cache_layer, reused_tokens, position, token_id, top1_id, runner_up_id, margin, logprob
FROM ${database}.`kvtrace_tokens`
SETTINGS insert_distributed_sync = 1;
EXCHANGE TABLES ${database}.${kvtrace_tokens} AND ${database}.${kvtrace_tokens_rebuilt} ${on_cluster};
DROP TABLE IF EXISTS ${database}.${kvtrace_tokens_rebuilt} ${on_cluster} SYNC;

-- kvtrace_cache_events
DROP TABLE IF EXISTS ${database}.${kvtrace_cache_events_rebuilt} ${on_cluster} SYNC;
ALTER TABLE ${database}.${otel_traces} ${on_cluster} MODIFY SETTING non_replicated_deduplication_window = 10000;
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_cache_events_rebuilt} ${on_cluster} (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String,
    SpanId String,
    run_id String,
    episode_id String,
    turn Int32,
    request_id String,
    engine LowCardinality(String),
    event LowCardinality(String),
    event_index UInt32,
    layer LowCardinality(String),
    outcome LowCardinality(String),
    key_hash String,
    tokens UInt32,
    prefix_tokens UInt32,
    entries_scanned UInt32,
    size_bytes UInt64,
    reason String,
    block_hashes Array(String),
    block_ids Array(Int64),
    parent_hash String,
    source_span_id String,
    source_trace_id String,
    source_request_id String,
    source_run_id String,
    source_episode_id String,
    source_turn Int32,
    source_time_unix_nano UInt64
) ENGINE = ${span_engine}
PARTITION BY toDate(Timestamp)
ORDER BY (run_id, episode_id, turn, Timestamp, TraceId, SpanId, event_index);
INSERT INTO ${kvtrace_cache_events_rebuilt_copy} (
    Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, event, event_index, layer,
    outcome, key_hash, tokens, prefix_tokens, entries_scanned, size_bytes, reason, block_hashes, block_ids,
    parent_hash, source_span_id, source_trace_id, source_request_id, source_run_id, source_episode_id,
    source_turn, source_time_unix_nano)
SELECT
    Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, event, event_index, layer,
    outcome, key_hash, tokens, prefix_tokens, entries_scanned, size_bytes, reason, block_hashes, block_ids,
    parent_hash, source_span_id, source_trace_id, source_request_id, source_run_id, source_episode_id,
    source_turn, source_time_unix_nano
FROM ${database}.`kvtrace_cache_events`
SETTINGS insert_distributed_sync = 1;
EXCHANGE TABLES ${database}.${kvtrace_cache_events} AND ${database}.${kvtrace_cache_events_rebuilt} ${on_cluster};
DROP TABLE IF EXISTS ${database}.${kvtrace_cache_events_rebuilt} ${on_cluster} SYNC;
ALTER TABLE ${database}.${otel_traces} ${on_cluster} MODIFY SETTING non_replicated_deduplication_window = 10000
