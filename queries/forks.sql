-- answers: Where runs A and B forked, per episode both runs contain.
--   Turns are walked in order; the fork is the first turn whose prompt hashes differ (kind `prompt`:
--   the fork happened upstream, in what was sent) or whose outputs differ (kind `output`). Outputs
--   are compared by token_ids when both sides captured them (ids or hashed capture), else by
--   output_hash. position is the first index where the token ids differ, or the shorter length
--   when one output is a prefix of the other; -1 when unknown (hash comparison), when the prompts
--   differ (kind `prompt`: outputs of different prompts are not compared token by token) or not forked.
--   Episodes that did not fork get a row with forked = 0 and fork_turn = position = -1.
--   turn_a / turn_b compare one turn of each run per episode instead (see shared/diff_sides.sql).
-- params: run_a String, run_b String, episode String = '', turn_a Int64 = -1, turn_b Int64 = -1
-- columns: episode_id, forked, fork_turn, fork_kind, position, compared_by, turns_compared,
--   turns_a, turns_b, span_id_a, span_id_b, token_a, token_b, output_tokens_a, output_tokens_b
WITH
${shared_requests_once}
(run) -> run IN ({run_a:String}, {run_b:String}) AS in_runs,
${shared_output_divergence}
${shared_diff_sides}
${shared_first_fork}
SELECT
    f.episode_id AS episode_id,
    f.found AS forked,
    if(f.found = 1, toInt64(f.turn), toInt64(-1)) AS fork_turn,
    multiIf(f.found = 0, '', f.prompt_differs, '${FORK_KIND_PROMPT}', '${FORK_KIND_OUTPUT}') AS fork_kind,
    if(f.found = 1, f.position, toInt64(-1)) AS position,
    if(if(f.found = 1, f.by_ids, f.any_by_ids), '${COMPARED_BY_TOKEN_IDS}', '${COMPARED_BY_OUTPUT_HASH}')
        AS compared_by,
    f.turns_compared AS turns_compared,
    f.turns_a AS turns_a,
    f.turns_b AS turns_b,
    if(f.found = 1, f.span_id_a, '') AS span_id_a,
    if(f.found = 1, f.span_id_b, '') AS span_id_b,
    if(f.found = 1, f.token_a, toInt64(-1)) AS token_a,
    if(f.found = 1, f.token_b, toInt64(-1)) AS token_b,
    if(f.found = 1, f.output_tokens_a, 0) AS output_tokens_a,
    if(f.found = 1, f.output_tokens_b, 0) AS output_tokens_b
FROM episode_forks AS f
ORDER BY episode_id
-- a missing array from the joins that fetch the forking turns' tokens reads as empty, as the lambdas expect
SETTINGS join_use_nulls = 0
