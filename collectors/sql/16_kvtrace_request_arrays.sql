-- kvtrace_request_arrays: where `kvtrace db ingest` hands over request spans whose per-token arrays it
-- already has as numbers (the spool packs them). Null engine: nothing is stored here; its view writes
-- kvtrace_requests with the arrays as they are, while the same spans go to otel_traces as the Collector
-- would write them. SpanAttributes holds the span's other attributes, as strings.
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_request_arrays} ${on_cluster} (
    Timestamp DateTime64(9),
    TraceId String,
    SpanId String,
    ParentSpanId String,
    SpanName LowCardinality(String),
    ServiceName LowCardinality(String),
    SpanAttributes Map(LowCardinality(String), String),
    Duration UInt64,
    StatusCode LowCardinality(String),
    token_ids Array(Int64),
    top1_ids Array(Int64),
    runner_up_ids Array(Int64),
    margins Array(Float64),
    logprobs Array(Float64)
) ENGINE = Null
