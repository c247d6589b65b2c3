-- answers: How often episodes fork, per configuration (engine, weight format, cache arm).
--   Runs are compared in pairs over the episodes both contain; an episode of a pair forked when any
--   turn's prompt or output differs (as in forks.sql). Pairs, for the runs whose id starts with
--   run_prefix ('' = every run):
--     baseline_arm = ''   every two runs of the same configuration (repeat passes of one arm: do
--                         repeats of the same cached configuration agree with each other?);
--     baseline_arm = ARM  every run of another arm against every run of ARM with the same engine and
--                         weight format (does caching change the outcome relative to, e.g., `off`?),
--                         plus pairs within ARM itself (its own noise floor).
--   fork_rate comes with a Wilson score 95 % interval; median fork turn / position are over forked
--   episodes (NaN when none forked; position -1 when outputs could only be compared by hash or the fork
--   was a prompt mismatch); mean_cached_tokens is the
--   mean reused prompt tokens per request over the configuration's runs.
--   Optional scope (what alert rules use): only requests with since <= Timestamp < until and the
--   given engine / model / weight format ('' = any).
-- params: run_prefix String = '', baseline_arm String = '', since DateTime64(3) = '1970-01-01 00:00:00',
--   until DateTime64(3) = '2200-01-01 00:00:00', engine String = '', model String = '',
--   weight_format String = ''
-- columns: engine, weight_format, arm, compared_with, runs, pairs, episodes_compared, episodes_forked,
--   fork_rate, ci_low, ci_high, median_fork_turn, median_fork_position, mean_cached_tokens
WITH
${shared_requests_once}
${shared_output_divergence}
${shared_wilson_interval}
${shared_request_scope}
requests AS (
    SELECT run_id, episode_id, turn, prompt_hash, output_hash, token_ids
    FROM requests_once AS q
    WHERE startsWith(run_id, {run_prefix:String}) AND episode_id != ''
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)  -- columns, not the aggregates' aliases
    ORDER BY run_id, episode_id, turn, Timestamp
    LIMIT 1 BY run_id, episode_id, turn
),
run_config AS (
    SELECT run_id, any(engine) AS engine, any(weight_format) AS weight_format, any(arm) AS arm
    FROM requests_once AS q
    WHERE startsWith(run_id, {run_prefix:String}) AND episode_id != ''
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)  -- columns, not the aggregates' aliases
    GROUP BY run_id
),
cached AS (
    SELECT engine, weight_format, arm, avg(reused_tokens) AS mean_cached_tokens
    FROM requests_once AS q
    WHERE startsWith(run_id, {run_prefix:String}) AND episode_id != ''
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)  -- columns, not the aggregates' aliases
    GROUP BY engine, weight_format, arm
),
pairs AS (
    SELECT a.run_id AS run_a, b.run_id AS run_b, a.engine AS engine, a.weight_format AS weight_format,
           a.arm AS arm, if({baseline_arm:String} = '', a.arm, b.arm) AS compared_with
    FROM run_config AS a
    INNER JOIN run_config AS b ON a.engine = b.engine AND a.weight_format = b.weight_format
    WHERE if({baseline_arm:String} = '',
             a.arm = b.arm AND a.run_id < b.run_id,
             (b.arm = {baseline_arm:String} AND a.arm != {baseline_arm:String})
             OR (a.arm = {baseline_arm:String} AND b.arm = {baseline_arm:String} AND a.run_id < b.run_id))
),
compared AS (
    SELECT
        p.engine AS engine, p.weight_format AS weight_format, p.arm AS arm, p.compared_with AS compared_with,
        p.run_a AS run_a, p.run_b AS run_b, ta.episode_id AS episode_id, ta.turn AS turn,
        ta.prompt_hash != tb.prompt_hash
            OR outputs_differ(ta.token_ids, tb.token_ids, ta.output_hash, tb.output_hash) AS differs,
        fork_position(ta.prompt_hash, tb.prompt_hash, ta.token_ids, tb.token_ids, ta.output_hash,
                      tb.output_hash) AS position
    FROM pairs AS p
    INNER JOIN requests AS ta ON ta.run_id = p.run_a
    INNER JOIN requests AS tb ON tb.run_id = p.run_b AND tb.episode_id = ta.episode_id AND tb.turn = ta.turn
),
episodes AS (
    SELECT engine, weight_format, arm, compared_with, run_a, run_b, episode_id,
           max(differs) AS forked,
           argMinIf(turn, turn, differs) AS fork_turn,
           argMinIf(position, turn, differs) AS fork_position
    FROM compared
    GROUP BY engine, weight_format, arm, compared_with, run_a, run_b, episode_id
),
rates AS (
    SELECT engine, weight_format, arm, compared_with,
           uniqExact(run_a, run_b) AS pairs,
           groupUniqArray(run_a) AS runs_a, groupUniqArray(run_b) AS runs_b,
           count() AS episodes_compared,
           sum(forked) AS episodes_forked,
           if(episodes_forked > 0, toFloat64(medianExactIf(fork_turn, forked = 1)), nan) AS median_fork_turn,
           if(episodes_forked > 0, toFloat64(medianExactIf(fork_position, forked = 1)), nan) AS median_fork_position
    FROM episodes
    GROUP BY engine, weight_format, arm, compared_with
)
SELECT
    r.engine AS engine, r.weight_format AS weight_format, r.arm AS arm, r.compared_with AS compared_with,
    length(arrayDistinct(arrayConcat(r.runs_a, r.runs_b))) AS runs,
    r.pairs AS pairs,
    r.episodes_compared AS episodes_compared,
    r.episodes_forked AS episodes_forked,
    r.episodes_forked / r.episodes_compared AS fork_rate,
    wilson_low(fork_rate, r.episodes_compared) AS ci_low,
    wilson_high(fork_rate, r.episodes_compared) AS ci_high,
    r.median_fork_turn AS median_fork_turn,
    r.median_fork_position AS median_fork_position,
    c.mean_cached_tokens AS mean_cached_tokens
FROM rates AS r
LEFT JOIN cached AS c ON c.engine = r.engine AND c.weight_format = r.weight_format AND c.arm = r.arm
ORDER BY engine, weight_format, arm
