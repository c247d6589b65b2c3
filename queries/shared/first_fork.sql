-- CTEs `compared`, `first_turns` and `episode_forks`: every turn both runs made, run A's request
-- against run B's, and per episode the first of those turns whose prompt or output differs: the
-- fork. Shared by forks and fork_attribution, which must find the same fork. Needs
-- shared_output_divergence and shared_diff_sides before it.
--   at_position(arr, pos, missing): arr's element at 0-based pos; missing when pos is -1 or past the end
--   compared: episode_id, turn, prompt_differs, by_ids (outputs compared by token ids),
--     output_differs (decided on the token arrays' digests: no array rides through the join),
--     capture_mode (side A's), and per side (suffix _a / _b): span_id, request_id, prompt_hash,
--     output_hash, output_tokens, layer, reused_tokens, prompt_tokens, state_key, hit_block_hashes,
--     source_span_id, source_request_id, source_run_id, source_episode_id, source_turn, turns (the
--     run's turns in the episode, compared or not), batch_composition, prefill_steps, slot_selected_by,
--     rows_cut_at, rows_cut_reason, finish_reason.
--   first_turns: one row per episode with a compared turn: compared's columns of the forking turn
--     and found = 1, or of the episode's first compared turn and found = 0 when it did not fork;
--     turns_compared and any_by_ids (some turn's outputs were compared by token ids) over the
--     episode's compared turns.
--   episode_forks: first_turns with, from that turn's token arrays (read again for these rows
--     alone), position (first differing token, 0-based; -1 when unknown or equal, and for a prompt
--     mismatch) and per side the token and runner_up there (-1 when none), the margin (nan), and the
--     rows and tokens of the step that computed it (step_rows, step_tokens; -1 when not recorded);
--     steps_differ: the steps of the tokens up to the fork (all, when its position is unknown) differ.
-- ClickHouse repeats a WITH subquery wherever it is referenced (planning and reading again), so
-- each is meant to be referenced once; per-episode figures ride along as window columns rather
-- than in a second pass over `compared`. Derived values are computed one subquery below where
-- they are used, so that each is planned once, not again at every mention.
(arr, pos, missing) -> if(pos >= 0 AND pos < length(arr), arr[pos + 1], missing) AS at_position,
-- the steps that computed tokens 0..pos (every step when the position is unknown): what a fork at pos rests on
(arr, pos) -> if(pos >= 0, arraySlice(arr, 1, pos + 1), arr) AS steps_up_to,
compared AS (
    SELECT
        a.episode_id AS episode_id,
        a.turn AS turn,
        a.prompt_hash != b.prompt_hash AS prompt_differs,
        a.has_ids AND b.has_ids AS by_ids,
        digests_differ(a.has_ids, b.has_ids, a.token_digest, b.token_digest, a.output_hash, b.output_hash)
            AS output_differs,
        a.capture_mode AS capture_mode,
        a.span_id AS span_id_a, b.span_id AS span_id_b,
        a.request_id AS request_id_a, b.request_id AS request_id_b,
        a.prompt_hash AS prompt_hash_a, b.prompt_hash AS prompt_hash_b,
        a.output_hash AS output_hash_a, b.output_hash AS output_hash_b,
        a.output_tokens AS output_tokens_a, b.output_tokens AS output_tokens_b,
        a.cache_layer AS layer_a, a.reused_tokens AS reused_tokens_a, a.prompt_tokens AS prompt_tokens_a,
        a.state_key AS state_key_a, a.hit_block_hashes AS hit_block_hashes_a,
        a.source_span_id AS source_span_id_a, a.source_request_id AS source_request_id_a,
        a.source_run_id AS source_run_id_a, a.source_episode_id AS source_episode_id_a,
        a.source_turn AS source_turn_a, a.episode_turns AS turns_a,
        a.batch_composition AS batch_composition_a, a.prefill_steps AS prefill_steps_a,
        a.slot_selected_by AS slot_selected_by_a,
        a.rows_cut_at AS rows_cut_at_a, a.rows_cut_reason AS rows_cut_reason_a, a.finish_reason AS finish_reason_a,
        b.cache_layer AS layer_b, b.reused_tokens AS reused_tokens_b, b.prompt_tokens AS prompt_tokens_b,
        b.state_key AS state_key_b, b.hit_block_hashes AS hit_block_hashes_b,
        b.source_span_id AS source_span_id_b, b.source_request_id AS source_request_id_b,
        b.source_run_id AS source_run_id_b, b.source_episode_id AS source_episode_id_b,
        b.source_turn AS source_turn_b, b.episode_turns AS turns_b,
        b.batch_composition AS batch_composition_b, b.prefill_steps AS prefill_steps_b,
        b.slot_selected_by AS slot_selected_by_b,
        b.rows_cut_at AS rows_cut_at_b, b.rows_cut_reason AS rows_cut_reason_b, b.finish_reason AS finish_reason_b
    FROM side_a AS a
    INNER JOIN side_b AS b ON a.episode_id = b.episode_id AND a.turn = b.turn
),
first_turns AS (
    SELECT *,
           toUInt8(prompt_differs OR output_differs) AS found,
           count() OVER episode AS turns_compared,
           max(by_ids) OVER episode AS any_by_ids
    FROM compared
    WINDOW episode AS (PARTITION BY episode_id)
    ORDER BY episode_id, found DESC, turn
    LIMIT 1 BY episode_id
),
-- The per-episode rows are the hash join's small side; each run's arrays stream past them, as one tuple a
-- side. The position is bound once through a one-element arrayMap and the values there read in the same
-- expression: naming each array column in an outer SELECT cost the analyzer as much again.
episode_forks AS (
    SELECT * EXCEPT (at),
           at.1 AS position, at.2 AS token_a, at.3 AS token_b, at.4 AS runner_up_a, at.5 AS runner_up_b,
           at.6 AS margin_a, at.7 AS margin_b, at.8 AS step_rows_a, at.9 AS step_rows_b,
           at.10 AS step_tokens_a, at.11 AS step_tokens_b, at.12 AS steps_differ
    FROM (
        SELECT f.* EXCEPT (arrays_a),
               arrayMap(p -> (p, at_position(f.arrays_a.1, p, toInt64(-1)), at_position(x.arrays.1, p, toInt64(-1)),
                              at_position(f.arrays_a.2, p, toInt64(-1)), at_position(x.arrays.2, p, toInt64(-1)),
                              at_position(f.arrays_a.3, p, nan), at_position(x.arrays.3, p, nan),
                              at_position(f.arrays_a.4, p, toInt64(-1)), at_position(x.arrays.4, p, toInt64(-1)),
                              at_position(f.arrays_a.5, p, toInt64(-1)), at_position(x.arrays.5, p, toInt64(-1)),
                              steps_up_to(f.arrays_a.4, p) != steps_up_to(x.arrays.4, p)
                                  OR steps_up_to(f.arrays_a.5, p) != steps_up_to(x.arrays.5, p)),
                        [fork_position(f.prompt_hash_a, f.prompt_hash_b, f.arrays_a.1, x.arrays.1)])[1] AS at
        FROM (SELECT SpanId, (token_ids, runner_up_ids, margins, step_rows, step_tokens) AS arrays
              FROM kvtrace_requests FINAL
              WHERE run_id = {run_b:String} AND ({episode:String} = '' OR episode_id = {episode:String})) AS x
        RIGHT JOIN (
            SELECT f.*, x.arrays AS arrays_a
            FROM (SELECT SpanId, (token_ids, runner_up_ids, margins, step_rows, step_tokens) AS arrays
                  FROM kvtrace_requests FINAL
                  WHERE run_id = {run_a:String} AND ({episode:String} = '' OR episode_id = {episode:String})) AS x
            RIGHT JOIN first_turns AS f ON x.SpanId = f.span_id_a
        ) AS f ON x.SpanId = f.span_id_b
    )
),
