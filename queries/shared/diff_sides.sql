-- CTEs `side_a` / `side_b`: the first request per (episode, turn) of runs A and B (optionally one
-- episode), with everything forks and fork_attribution read but the per-token arrays (has_ids and
-- the stored token_digest stand for them: queries/shared/output_divergence.sql), and episode_turns: how many
-- turns of the episode the side holds (compared with the other side or not). Needs shared_requests_once
-- before it and params run_a, run_b, episode, turn_a, turn_b. With turn_a and turn_b (>= 0; -1 =
-- every turn) side A is run A's turn turn_a and side B run B's turn turn_b of each episode, compared
-- as one turn numbered turn_b; the two runs may then be one (a probe's cold turn 0 against a warm
-- turn). The run_id filter of each side reaches the table (through the LIMIT BY), so each side
-- reads only its own run; reference each side once per query, as every reference reads it again.
sides AS (
    SELECT run_id, episode_id, turn, SpanId AS span_id, request_id, capture_mode, prompt_hash, output_hash,
           notEmpty(token_ids) AS has_ids, token_digest, output_tokens, cache_layer,
           reused_tokens, prompt_tokens,
           state_key, hit_block_hashes, source_span_id, source_request_id, source_run_id, source_episode_id,
           source_turn, batch_composition, prefill_steps, slot_selected_by, rows_cut_at, rows_cut_reason,
           finish_reason
    FROM requests_once
    WHERE run_id IN ({run_a:String}, {run_b:String}) AND episode_id != ''
      AND ({episode:String} = '' OR episode_id = {episode:String})
      AND ({turn_a:Int64} < 0 OR turn IN ({turn_a:Int64}, {turn_b:Int64}))
    ORDER BY run_id, episode_id, turn, Timestamp
    LIMIT 1 BY run_id, episode_id, turn
),
side_a AS (
    -- renumbered outside the filter: a WHERE would read the replaced turn
    SELECT * REPLACE (if({turn_a:Int64} < 0, toInt64(turn), {turn_b:Int64}) AS turn),
           count() OVER (PARTITION BY episode_id) AS episode_turns
    FROM (SELECT * FROM sides WHERE run_id = {run_a:String} AND ({turn_a:Int64} < 0 OR turn = {turn_a:Int64}))
),
side_b AS (
    SELECT * REPLACE (toInt64(turn) AS turn), count() OVER (PARTITION BY episode_id) AS episode_turns
    FROM sides
    WHERE run_id = {run_b:String} AND ({turn_b:Int64} < 0 OR turn = {turn_b:Int64})
),
