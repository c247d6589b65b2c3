-- CTEs `compared` and `first_fork`: every turn both runs made, run A's request against run B's, and
-- per episode the first of those turns whose prompt or output differs: the fork. Shared by forks and
-- fork_attribution, which must find the same fork. Needs shared_output_divergence and
-- shared_diff_sides before it.
--   at_position(arr, pos, missing): arr's element at 0-based pos; missing when pos is -1 or past the end
--   compared: episode_id, turn, prompt_differs, by_ids (outputs compared by token ids),
--     output_differs, position (first differing token, 0-based; -1 when unknown or equal, and for a
--     prompt mismatch),
--     capture_mode (side A's), and per side (suffix _a / _b): span_id, request_id, token and
--     runner_up at the position (-1 when none), margin there (nan when none), output_tokens,
--     layer, reused_tokens, prompt_tokens, state_key, hit_block_hashes, source_span_id,
--     source_request_id, source_run_id, source_episode_id, source_turn.
--     Arrays are compared whole, never exploded per token.
--   first_fork: compared's columns of the forking turn, and found = 1 (0 where a LEFT JOIN with
--     join_use_nulls = 0 finds no fork)
(arr, pos, missing) -> if(pos >= 0 AND pos < length(arr), arr[pos + 1], missing) AS at_position,
compared AS (
    SELECT
        a.episode_id AS episode_id,
        a.turn AS turn,
        a.prompt_hash != b.prompt_hash AS prompt_differs,
        outputs_compared_by_ids(a.token_ids, b.token_ids) AS by_ids,
        outputs_differ(a.token_ids, b.token_ids, a.output_hash, b.output_hash) AS output_differs,
        fork_position(a.prompt_hash, b.prompt_hash, a.token_ids, b.token_ids, a.output_hash, b.output_hash)
            AS position,
        a.capture_mode AS capture_mode,
        a.span_id AS span_id_a, b.span_id AS span_id_b,
        a.request_id AS request_id_a, b.request_id AS request_id_b,
        at_position(a.token_ids, position, toInt64(-1)) AS token_a,
        at_position(b.token_ids, position, toInt64(-1)) AS token_b,
        at_position(a.runner_up_ids, position, toInt64(-1)) AS runner_up_a,
        at_position(b.runner_up_ids, position, toInt64(-1)) AS runner_up_b,
        at_position(a.margins, position, nan) AS margin_a,
        at_position(b.margins, position, nan) AS margin_b,
        a.output_tokens AS output_tokens_a, b.output_tokens AS output_tokens_b,
        a.cache_layer AS layer_a, a.reused_tokens AS reused_tokens_a, a.prompt_tokens AS prompt_tokens_a,
        a.state_key AS state_key_a, a.hit_block_hashes AS hit_block_hashes_a,
        a.source_span_id AS source_span_id_a, a.source_request_id AS source_request_id_a,
        a.source_run_id AS source_run_id_a, a.source_episode_id AS source_episode_id_a,
        a.source_turn AS source_turn_a,
        b.cache_layer AS layer_b, b.reused_tokens AS reused_tokens_b, b.prompt_tokens AS prompt_tokens_b,
        b.state_key AS state_key_b, b.hit_block_hashes AS hit_block_hashes_b,
        b.source_span_id AS source_span_id_b, b.source_request_id AS source_request_id_b,
        b.source_run_id AS source_run_id_b, b.source_episode_id AS source_episode_id_b,
        b.source_turn AS source_turn_b
    FROM side_a AS a
    INNER JOIN side_b AS b ON a.episode_id = b.episode_id AND a.turn = b.turn
),
first_fork AS (
    SELECT *, 1 AS found
    FROM compared
    WHERE prompt_differs OR output_differs
    ORDER BY episode_id, turn
    LIMIT 1 BY episode_id
),
