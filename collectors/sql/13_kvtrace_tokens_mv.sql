-- Explodes the per-token arrays of kvtrace_requests into kvtrace_tokens (chained on the typed table).
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${kvtrace_tokens_mv} ${on_cluster}
TO ${database}.${kvtrace_tokens}
AS SELECT
    Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, weight_format, arm,
    prompt_hash, cache_layer, reused_tokens,
    toUInt32(position) AS position, token_id, top1_id, runner_up_id, margin, logprob
FROM ${database}.${kvtrace_requests}
ARRAY JOIN
    range(greatest(length(token_ids), length(margins))) AS position,
    arrayResize(token_ids, greatest(length(token_ids), length(margins)), toInt64(-1)) AS token_id,
    arrayResize(top1_ids, greatest(length(token_ids), length(margins)), toInt64(-1)) AS top1_id,
    arrayResize(runner_up_ids, greatest(length(token_ids), length(margins)), toInt64(-1)) AS runner_up_id,
    arrayResize(margins, greatest(length(token_ids), length(margins)), nan) AS margin,
    arrayResize(logprobs, greatest(length(token_ids), length(margins)), nan) AS logprob
