-- Explodes kvtrace.request spans of otel_traces into kvtrace_requests (attributes arrive as strings).
-- `kvtrace db ingest` hands its request spans with packed arrays to kvtrace_request_spans, naming the insert
-- in log_comment: the rows that table's view writes into otel_traces are passed over here, as those spans
-- reach kvtrace_requests through 18_kvtrace_request_spans_mv.sql.
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${kvtrace_requests_mv} ${on_cluster}
TO ${database}.${kvtrace_requests}
AS SELECT
    ${kvtrace_request_columns},
    JSONExtract(SpanAttributes['${OUTPUT_TOKEN_IDS}'], 'Array(Int64)') AS token_ids,
    JSONExtract(SpanAttributes['${OUTPUT_TOP1_IDS}'], 'Array(Int64)') AS top1_ids,
    JSONExtract(SpanAttributes['${OUTPUT_RUNNER_UP_IDS}'], 'Array(Int64)') AS runner_up_ids,
    JSONExtract(SpanAttributes['${OUTPUT_MARGINS}'], 'Array(Float64)') AS margins,
    JSONExtract(SpanAttributes['${OUTPUT_LOGPROBS}'], 'Array(Float64)') AS logprobs
FROM ${database}.${otel_traces}
WHERE SpanName = '${SPAN_REQUEST}'
    AND getSetting('log_comment') != '${typed_ingest_comment}'
