-- Request spans handed over with typed per-token arrays → kvtrace_requests (the other columns computed
-- as 11_kvtrace_requests_mv.sql computes them).
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${kvtrace_request_arrays_mv} ${on_cluster}
TO ${database}.${kvtrace_requests}
AS SELECT
    ${kvtrace_request_columns},
    token_ids,
    top1_ids,
    runner_up_ids,
    margins,
    logprobs
FROM ${database}.${kvtrace_request_arrays}
WHERE SpanName = '${SPAN_REQUEST}'
