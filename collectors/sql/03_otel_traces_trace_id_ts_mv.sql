-- Feeds otel_traces_trace_id_ts from otel_traces, as the Collector exporter does.
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${otel_traces_trace_id_ts_mv} ${on_cluster}
TO ${database}.${otel_traces_trace_id_ts}
AS SELECT
    TraceId,
    min(Timestamp) AS Start,
    max(Timestamp) AS End
FROM ${database}.${otel_traces}
WHERE TraceId != ''
GROUP BY TraceId
