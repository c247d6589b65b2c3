-- kvtrace_request_spans: where `kvtrace db ingest` hands over kvtrace.request spans whose per-token arrays
-- are plain finite numbers. Null engine: nothing is stored here. Its views write each span twice, from
-- one insert: into otel_traces as the OpenTelemetry Collector's exporter would write it (17_…), and into
-- kvtrace_requests with the arrays as numbers (18_…), so neither the arrays' text nor its parsing passes
-- through Python. The columns are otel_traces' own, plus each per-token array packed: its elements as
-- little-endian int64 / float64 bytes (kvtrace/recording/packed_arrays.py). In SpanAttributes each array
-- attribute the span has is present with an empty value, at the span's place for it; the arrays stand
-- side by side in the order of the packed columns (ingest sends other spans the JSON view's way).
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_request_spans} ${on_cluster} (
    Timestamp DateTime64(9),
    TraceId String,
    SpanId String,
    ParentSpanId String,
    TraceState String,
    SpanName LowCardinality(String),
    SpanKind LowCardinality(String),
    ServiceName LowCardinality(String),
    ResourceAttributes Map(LowCardinality(String), String),
    ScopeName String,
    ScopeVersion String,
    SpanAttributes Map(LowCardinality(String), String),
    Duration UInt64,
    StatusCode LowCardinality(String),
    StatusMessage String,
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ),
    packed_token_ids String,
    packed_top1_ids String,
    packed_runner_up_ids String,
    packed_margins String,
    packed_logprobs String
) ENGINE = Null
