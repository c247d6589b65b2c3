-- CTEs `compared` and `episode_forks`: every turn both runs made, run A's request against run B's,
-- and per episode the first of those turns whose prompt or output differs: the fork. Shared by forks
-- and fork_attribution, which must find the same fork. Needs shared_output_divergence and
-- shared_diff_sides before it.
--   at_position(arr, pos, missing): arr's element at 0-based pos; missing when pos is -1 or past the end
--   compared: episode_id, turn, prompt_differs, by_ids (outputs compared by token ids),
--     output_differs, position (first differing token, 0-based; -1 when unknown or equal, and for a
--     prompt mismatch),
--     capture_mode (side A's), and per side (suffix _a / _b): span_id, request_id, token and
--     runner_up at the position (-1 when none), margin there (nan when none), output_tokens,
--     layer, reused_tokens, prompt_tokens, state_key, hit_block_hashes, source_span_id,
--     source_request_id, source_run_id, source_episode_id, source_turn, turns (the run's turns in
--     the episode, compared or not). Arrays are compared whole, never exploded per token.
--   episode_forks: one row per episode with a compared turn: compared's columns of the forking turn
--     and found = 1, or of the episode's first compared turn and found = 0 when it did not fork;
--     turns_compared and any_by_ids (some turn's outputs were compared by token ids) over the
--     episode's compared turns.
-- ClickHouse repeats a WITH subquery wherever it is referenced (planning and reading again), so
-- both are meant to be referenced once; per-episode figures ride along as window columns rather
-- than in a second pass over `compared`. Derived values are computed one subquery below where
-- they are used, so that each is planned once, not again at every mention.
(arr, pos, missing) -> if(pos >= 0 AND pos < length(arr), arr[pos + 1], missing) AS at_position,
compared AS (
    SELECT
        * EXCEPT (token_ids_a, token_ids_b, runner_up_ids_a, runner_up_ids_b, margins_a, margins_b),
        at_position(token_ids_a, position, toInt64(-1)) AS token_a,
        at_position(token_ids_b, position, toInt64(-1)) AS token_b,
        at_position(runner_up_ids_a, position, toInt64(-1)) AS runner_up_a,
        at_position(runner_up_ids_b, position, toInt64(-1)) AS runner_up_b,
        at_position(margins_a, position, nan) AS margin_a,
        at_position(margins_b, position, nan) AS margin_b
    FROM (
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
            a.token_ids AS token_ids_a, b.token_ids AS token_ids_b,
            a.runner_up_ids AS runner_up_ids_a, b.runner_up_ids AS runner_up_ids_b,
            a.margins AS margins_a, b.margins AS margins_b,
            a.output_tokens AS output_tokens_a, b.output_tokens AS output_tokens_b,
            a.cache_layer AS layer_a, a.reused_tokens AS reused_tokens_a, a.prompt_tokens AS prompt_tokens_a,
            a.state_key AS state_key_a, a.hit_block_hashes AS hit_block_hashes_a,
            a.source_span_id AS source_span_id_a, a.source_request_id AS source_request_id_a,
            a.source_run_id AS source_run_id_a, a.source_episode_id AS source_episode_id_a,
            a.source_turn AS source_turn_a, a.episode_turns AS turns_a,
            b.cache_layer AS layer_b, b.reused_tokens AS reused_tokens_b, b.prompt_tokens AS prompt_tokens_b,
            b.state_key AS state_key_b, b.hit_block_hashes AS hit_block_hashes_b,
            b.source_span_id AS source_span_id_b, b.source_request_id AS source_request_id_b,
            b.source_run_id AS source_run_id_b, b.source_episode_id AS source_episode_id_b,
            b.source_turn AS source_turn_b, b.episode_turns AS turns_b
        FROM side_a AS a
        INNER JOIN side_b AS b ON a.episode_id = b.episode_id AND a.turn = b.turn
    )
),
episode_forks AS (
    SELECT *,
           toUInt8(prompt_differs OR output_differs) AS found,
           count() OVER episode AS turns_compared,
           max(by_ids) OVER episode AS any_by_ids
    FROM compared
    WINDOW episode AS (PARTITION BY episode_id)
    ORDER BY episode_id, found DESC, turn
    LIMIT 1 BY episode_id
),
