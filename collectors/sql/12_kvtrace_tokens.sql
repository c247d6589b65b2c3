-- kvtrace_tokens: one row per generated token (position 0 = first generated token of the request).
-- One row per span (and position / event) whatever path stored it and how often: the sort key ends with the
-- span's ids, so the engine folds copies into one; queries read FINAL. Ordered by run first: two runs are read
-- without the rest of the table.
-- token_id / top1_id / runner_up_id are -1 when the capture policy kept no ids.
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_tokens} ${on_cluster} (
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
ORDER BY (run_id, episode_id, turn, position, TraceId, SpanId)
