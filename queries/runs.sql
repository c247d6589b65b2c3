-- answers: Which runs the database holds, with their configuration and counts.
--   One row per run id: engine, model, weight formats and arms seen, how many episodes (requests
--   with no episode id are not one), requests (each once: a probed request the engine also
--   recorded counts once), generated tokens and cache-served prompt tokens, first and last request time,
--   how many cache integrity violations its requests met (states not their prompt's own prefix), and
--   shadow_twins: of its requests, the cold twins `kvtrace proxy --shadow` sent of live cache hits
--   (arm shadow; the live sample margin_shift's shadow_pairs rest on).
-- params: none
-- columns: run_id, engine, model, weight_formats, arms, episodes, requests, output_tokens,
--   cached_prompt_tokens, prompt_tokens, first_seen, last_seen, shadow_twins, integrity_violations
WITH
${shared_requests_once}
(run) -> true AS in_runs,
per_run AS (
    SELECT
        run_id,
        any(engine) AS engine,
        any(model) AS model,
        arrayStringConcat(groupUniqArray(weight_format), ',') AS weight_formats,
        arrayStringConcat(groupUniqArray(arm), ',') AS arms,
        uniqExactIf(episode_id, episode_id != '') AS episodes,
        count() AS requests,
        sum(output_tokens) AS output_tokens,
        sum(reused_tokens) AS cached_prompt_tokens,
        sum(prompt_tokens) AS prompt_tokens,
        min(Timestamp) AS first_seen,
        max(Timestamp) AS last_seen,
        countIf(arm = '${ARM_SHADOW}') AS shadow_twins
    FROM requests_once
    GROUP BY run_id
),
violations AS (
    -- each event once, however many copies of its span were stored
    SELECT run_id, uniqExact(SpanId, event_index) AS integrity_violations
    FROM kvtrace_cache_events
    WHERE event = '${EVENT_CACHE_INTEGRITY_VIOLATION}'
    GROUP BY run_id
)
SELECT per_run.*, v.integrity_violations AS integrity_violations
FROM per_run
LEFT JOIN violations AS v ON v.run_id = per_run.run_id
ORDER BY first_seen
SETTINGS join_use_nulls = 0
