-- Request spans handed over by ingest → kvtrace_requests, the per-token arrays as the numbers they are (the
-- other columns computed as 11_kvtrace_requests_mv.sql computes them). A negative zero becomes 0, as it
-- does through the JSON view, which reads the Collector's text "-0" back as 0.
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${kvtrace_request_spans_mv} ${on_cluster}
TO ${database}.${kvtrace_requests}
AS SELECT
    ${kvtrace_request_columns},
    reinterpret(packed_token_ids, 'Array(Int64)') AS token_ids,
    reinterpret(packed_top1_ids, 'Array(Int64)') AS top1_ids,
    reinterpret(packed_runner_up_ids, 'Array(Int64)') AS runner_up_ids,
    arrayMap(x -> x + 0., reinterpret(packed_margins, 'Array(Float64)')) AS margins,
    arrayMap(x -> x + 0., reinterpret(packed_logprobs, 'Array(Float64)')) AS logprobs
FROM ${database}.${kvtrace_request_spans}
WHERE SpanName = '${SPAN_REQUEST}'
