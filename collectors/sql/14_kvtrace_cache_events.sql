-- kvtrace_cache_events: one row per cache event (lookup, reuse, restore, store, evict, reset).
-- One row per span (and position / event) whatever path stored it and how often: the sort key ends with the
-- span's ids, so the engine folds copies into one; queries read FINAL. Ordered by run first: two runs are read
-- without the rest of the table.
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_cache_events} ${on_cluster} (
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
ORDER BY (run_id, episode_id, turn, Timestamp, TraceId, SpanId, event_index)
