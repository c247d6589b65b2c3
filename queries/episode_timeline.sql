-- answers: What each of runs A and B did in one episode, turn by turn: the cache path that served
--   each prompt, the cache events of each request, and the per-token choices and margins (what the
--   diff and the HTML fork view draw). One row per run and turn, run A first.
-- params: run_a String, run_b String, episode String
-- columns: side, run_id, turn, span_id, request_id, capture_mode, prompt_hash, prompt_tokens,
--   cache_layer, reused_tokens, state_key, source_request_id, source_run_id, source_episode_id,
--   source_turn, source_span_id, output_hash, token_ids, top1_ids, runner_up_ids, margins,
--   event_names, event_layers, event_outcomes, event_tokens
WITH
${shared_requests_once}
(run) -> run IN ({run_a:String}, {run_b:String}) AS in_runs,
requests AS (
    SELECT run_id, turn, SpanId AS span_id, request_id, capture_mode, prompt_hash, prompt_tokens,
           cache_layer, reused_tokens, state_key, source_request_id, source_run_id, source_episode_id,
           source_turn, source_span_id, output_hash, token_ids, top1_ids, runner_up_ids, margins
    FROM requests_once
    WHERE run_id IN ({run_a:String}, {run_b:String}) AND episode_id = {episode:String}
    ORDER BY run_id, turn, Timestamp
    LIMIT 1 BY run_id, turn
),
events AS (
    SELECT SpanId AS span_id,
           arraySort(e -> e.1, groupArray((event_index, event, layer, outcome, tokens))) AS ordered
    FROM kvtrace_cache_events FINAL  -- a span stored twice: its events once
    WHERE run_id IN ({run_a:String}, {run_b:String}) AND episode_id = {episode:String}
    GROUP BY SpanId
)
SELECT
    if(r.run_id = {run_a:String}, 'a', 'b') AS side,
    r.run_id AS run_id, toInt64(r.turn) AS turn, r.span_id AS span_id, r.request_id AS request_id,
    r.capture_mode AS capture_mode, r.prompt_hash AS prompt_hash, r.prompt_tokens AS prompt_tokens,
    r.cache_layer AS cache_layer, r.reused_tokens AS reused_tokens, r.state_key AS state_key,
    r.source_request_id AS source_request_id, r.source_run_id AS source_run_id,
    r.source_episode_id AS source_episode_id, toInt64(r.source_turn) AS source_turn,
    r.source_span_id AS source_span_id, r.output_hash AS output_hash,
    r.token_ids AS token_ids, r.top1_ids AS top1_ids, r.runner_up_ids AS runner_up_ids, r.margins AS margins,
    arrayMap(e -> toString(e.2), e.ordered) AS event_names,
    arrayMap(e -> toString(e.3), e.ordered) AS event_layers,
    arrayMap(e -> toString(e.4), e.ordered) AS event_outcomes,
    arrayMap(e -> toUInt32(e.5), e.ordered) AS event_tokens
FROM requests AS r
LEFT JOIN events AS e ON e.span_id = r.span_id
ORDER BY side, turn
SETTINGS join_use_nulls = 0
