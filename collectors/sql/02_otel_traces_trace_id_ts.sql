-- otel_traces_trace_id_ts: first/last timestamp per trace id (the Collector exporter's lookup table).
CREATE TABLE IF NOT EXISTS ${database}.${otel_traces_trace_id_ts} ${on_cluster} (
    TraceId String CODEC(ZSTD(1)),
    Start SimpleAggregateFunction(min, DateTime) CODEC(ZSTD(1)),
    End SimpleAggregateFunction(max, DateTime) CODEC(ZSTD(1))
) ENGINE = ${engine}
PARTITION BY toStartOfWeek(Start)
ORDER BY (TraceId)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1
