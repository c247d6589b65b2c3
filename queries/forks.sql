-- answers: Where runs A and B forked, per episode both runs contain.
--   Turns are walked in order; the fork is the first turn whose prompt hashes differ (kind `prompt`:
--   the fork happened upstream, in what was sent) or whose outputs differ (kind `output`). Outputs
--   are compared by token_ids when both sides captured them (ids or hashed capture), else by
--   output_hash. position is the first index where the token ids differ, or the shorter length
--   when one output is a prefix of the other; -1 when unknown (hash comparison), when the prompts
--   differ (kind `prompt`: outputs of different prompts are not compared token by token) or not forked.
--   Episodes that did not fork get a row with forked = 0 and fork_turn = position = -1.
-- params: run_a String, run_b String, episode String = ''
-- columns: episode_id, forked, fork_turn, fork_kind, position, compared_by, turns_compared,
--   turns_a, turns_b, span_id_a, span_id_b, token_a, token_b, output_tokens_a, output_tokens_b
WITH
${shared_output_divergence}
${shared_diff_sides}
-- One row per turn both runs made; arrays are compared whole, never exploded per token.
compared AS (
    SELECT
        a.episode_id AS episode_id,
        a.turn AS turn,
        a.span_id AS span_id_a,
        b.span_id AS span_id_b,
        a.prompt_hash != b.prompt_hash AS prompt_differs,
        outputs_compared_by_ids(a.token_ids, b.token_ids) AS by_ids,
        outputs_differ(a.token_ids, b.token_ids, a.output_hash, b.output_hash) AS output_differs,
        fork_position(a.prompt_hash, b.prompt_hash, a.token_ids, b.token_ids, a.output_hash, b.output_hash)
            AS position,
        if(position >= 0 AND position < length(a.token_ids), a.token_ids[position + 1], toInt64(-1)) AS token_a,
        if(position >= 0 AND position < length(b.token_ids), b.token_ids[position + 1], toInt64(-1)) AS token_b,
        a.output_tokens AS output_tokens_a,
        b.output_tokens AS output_tokens_b
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
per_episode AS (
    SELECT episode_id, count() AS turns_compared, max(by_ids) AS any_by_ids
    FROM compared
    GROUP BY episode_id
),
turn_counts_a AS (SELECT episode_id, count() AS turns FROM side_a GROUP BY episode_id),
turn_counts_b AS (SELECT episode_id, count() AS turns FROM side_b GROUP BY episode_id)
SELECT
    e.episode_id AS episode_id,
    toUInt8(f.found) AS forked,
    if(f.found = 1, toInt64(f.turn), toInt64(-1)) AS fork_turn,
    multiIf(f.found = 0, '', f.prompt_differs, 'prompt', 'output') AS fork_kind,
    if(f.found = 1, f.position, toInt64(-1)) AS position,
    if(if(f.found = 1, f.by_ids, e.any_by_ids), 'token_ids', 'output_hash') AS compared_by,
    e.turns_compared AS turns_compared,
    ta.turns AS turns_a,
    tb.turns AS turns_b,
    f.span_id_a AS span_id_a,
    f.span_id_b AS span_id_b,
    if(f.found = 1, f.token_a, toInt64(-1)) AS token_a,
    if(f.found = 1, f.token_b, toInt64(-1)) AS token_b,
    f.output_tokens_a AS output_tokens_a,
    f.output_tokens_b AS output_tokens_b
FROM per_episode AS e
LEFT JOIN first_fork AS f ON f.episode_id = e.episode_id
LEFT JOIN turn_counts_a AS ta ON ta.episode_id = e.episode_id
LEFT JOIN turn_counts_b AS tb ON tb.episode_id = e.episode_id
ORDER BY episode_id
SETTINGS join_use_nulls = 0
