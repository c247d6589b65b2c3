-- kvtrace_requests: one row per generation request (one kvtrace.request span), typed.
-- One row per span (and position / event) whatever path stored it and how often: the sort key ends with the
-- span's ids, so the engine folds copies into one; queries read FINAL. Ordered by run first: two runs are read
-- without the rest of the table. The per-token arrays' codecs read several times faster than LZ4 (T64 packs small
-- token ids; no general codec shrinks margins or keyed hashes).
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_requests} ${on_cluster} (
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
    token_ids Array(Int64) CODEC(T64),
    top1_ids Array(Int64) CODEC(T64),
    runner_up_ids Array(Int64) CODEC(T64),
    margins Array(Float64) CODEC(NONE),
    logprobs Array(Float64) CODEC(NONE),
    -- Equal arrays, equal digests: queries find which outputs differ without reading or joining the arrays.
    token_digest UInt64 MATERIALIZED cityHash64(token_ids),
    finish_reason LowCardinality(String),
    status_code LowCardinality(String),
    duration_ns UInt64,
    -- Batch composition (docs/batching.md): per generated token the rows and tokens of its engine step; the
    -- prompt's computed tokens per step.
    batch_composition LowCardinality(String),
    step_rows Array(Int64) CODEC(T64),
    step_tokens Array(Int64) CODEC(T64),
    prefill_steps Array(Int64) CODEC(T64)
) ENGINE = ${span_engine}
PARTITION BY toDate(Timestamp)
ORDER BY (run_id, episode_id, turn, Timestamp, TraceId, SpanId)
