-- CTEs `side_a` / `side_b`: the first request per (episode, turn) of runs A and B (optionally one
-- episode), with everything forks and fork_attribution read. Needs params run_a, run_b, episode.
sides AS (
    SELECT run_id, episode_id, turn, SpanId AS span_id, request_id, capture_mode, prompt_hash, output_hash,
           token_ids, runner_up_ids, margins, output_tokens, cache_layer, reused_tokens, prompt_tokens,
           state_key, hit_block_hashes, source_span_id, source_request_id, source_run_id, source_episode_id,
           source_turn
    FROM kvtrace_requests
    WHERE run_id IN ({run_a:String}, {run_b:String}) AND episode_id != ''
      AND ({episode:String} = '' OR episode_id = {episode:String})
    ORDER BY run_id, episode_id, turn, Timestamp
    LIMIT 1 BY run_id, episode_id, turn
),
side_a AS (SELECT * FROM sides WHERE run_id = {run_a:String}),
side_b AS (SELECT * FROM sides WHERE run_id = {run_b:String}),
