-- answers: Which runs the database holds, with their configuration and counts.
--   One row per run id: engine, model, weight formats and arms seen, how many episodes (requests
--   with no episode id are not one), requests (each once: a probed request the engine also
--   recorded counts once), generated tokens and cache-served prompt tokens, first and last request time.
-- params: none
-- columns: run_id, engine, model, weight_formats, arms, episodes, requests, output_tokens,
--   cached_prompt_tokens, prompt_tokens, first_seen, last_seen
WITH
${shared_requests_once}
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
        max(Timestamp) AS last_seen
    FROM requests_once
    GROUP BY run_id
)
SELECT * FROM per_run
ORDER BY first_seen
