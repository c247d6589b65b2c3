-- answers: How each compared turn of runs A and B was served, forked or not: both sides' cache paths.
--   One row per episode and turn both runs contain (the turns forks compares; with turn_a / turn_b,
--   run A's turn turn_a against run B's turn turn_b, numbered turn_b). Per side: the cache layer,
--   reused and prompt tokens, the state key, and the request that stored the reused state (its run,
--   episode and turn; empty / -1 when unknown) and how llama-server chose its slot ('' when not
--   recorded). Read from the engine's record where a probed request has one (shared/requests_once.sql).
-- params: run_a String, run_b String, episode String = '', turn_a Int64 = -1, turn_b Int64 = -1
-- columns: episode_id, turn, span_id_a, span_id_b, layer_a, reused_tokens_a, prompt_tokens_a,
--   state_key_a, source_run_id_a, source_episode_id_a, source_turn_a, layer_b, reused_tokens_b,
--   prompt_tokens_b, state_key_b, source_run_id_b, source_episode_id_b, source_turn_b, slot_selected_by_a,
--   slot_selected_by_b
WITH
${shared_requests_once}
(run) -> run IN ({run_a:String}, {run_b:String}) AS in_runs,
${shared_diff_sides}
paired AS (
    SELECT
        a.episode_id AS episode_id, a.turn AS turn, a.span_id AS span_id_a, b.span_id AS span_id_b,
        a.cache_layer AS layer_a, a.reused_tokens AS reused_tokens_a, a.prompt_tokens AS prompt_tokens_a,
        a.state_key AS state_key_a, a.source_run_id AS source_run_id_a,
        a.source_episode_id AS source_episode_id_a, toInt64(a.source_turn) AS source_turn_a,
        b.cache_layer AS layer_b, b.reused_tokens AS reused_tokens_b, b.prompt_tokens AS prompt_tokens_b,
        b.state_key AS state_key_b, b.source_run_id AS source_run_id_b,
        b.source_episode_id AS source_episode_id_b, toInt64(b.source_turn) AS source_turn_b,
        a.slot_selected_by AS slot_selected_by_a, b.slot_selected_by AS slot_selected_by_b
    FROM side_a AS a
    INNER JOIN side_b AS b ON a.episode_id = b.episode_id AND a.turn = b.turn
)
SELECT * FROM paired
ORDER BY episode_id, turn
