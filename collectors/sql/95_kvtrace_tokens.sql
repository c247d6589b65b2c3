-- kvtrace_tokens: one row per generated token (position 0 = first generated token of the request), for ad hoc SQL.
-- A view, not a table: the rows are kvtrace_requests' per-token arrays read FINAL (each span once), so they are
-- stored once and cost ingest nothing; the saved queries compare the arrays themselves. It reads the plain
-- kvtrace_requests, which on a cluster is the Distributed table in front of every shard.
-- token_id / top1_id / runner_up_id are -1 when the capture policy kept no ids; margin and logprob NaN where a
-- request recorded ids without them; batch_rows / batch_tokens (the rows and tokens of its engine step) -1 where
-- the batch composition is not recorded.
CREATE OR REPLACE VIEW ${database}.${kvtrace_tokens_view} ${on_cluster} AS
SELECT
    Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, weight_format, arm,
    prompt_hash, cache_layer, reused_tokens,
    toUInt32(position) AS position, token_id, top1_id, runner_up_id, margin, logprob, batch_rows, batch_tokens
FROM ${database}.`kvtrace_requests` FINAL
ARRAY JOIN
    range(greatest(length(token_ids), length(margins))) AS position,
    arrayResize(token_ids, greatest(length(token_ids), length(margins)), toInt64(-1)) AS token_id,
    arrayResize(top1_ids, greatest(length(token_ids), length(margins)), toInt64(-1)) AS top1_id,
    arrayResize(runner_up_ids, greatest(length(token_ids), length(margins)), toInt64(-1)) AS runner_up_id,
    arrayResize(margins, greatest(length(token_ids), length(margins)), nan) AS margin,
    arrayResize(logprobs, greatest(length(token_ids), length(margins)), nan) AS logprob,
    arrayResize(step_rows, greatest(length(token_ids), length(margins)), toInt64(-1)) AS batch_rows,
    arrayResize(step_tokens, greatest(length(token_ids), length(margins)), toInt64(-1)) AS batch_tokens
