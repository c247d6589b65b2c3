-- answers: How often episodes fork, per configuration, counting each distinct episode once.
--   A configuration is the engine, model, weight format, KV cache type and numerics settings (batch
--   sizes, flash attention, threads...), plus the arm and its cache settings (e.g. the prompt cache's
--   capacity). An episode's trajectory in a run is every turn's prompt and output; runs whose
--   trajectories of an episode are bit-identical are one observation of it, not several.
--   Rows, for the runs whose id starts with run_prefix ('' = every run):
--     baseline_arm = ARM  every other arm against ARM under the same engine, model, format, KV type and
--       numerics (does caching change the outcome?). The samples of an episode are its distinct
--       (trajectory, baseline trajectory) pairs: one when every repeat and order of the arm agrees
--       with itself, more when orders (or repeats) give different trajectories. A sample forked when
--       some turn both sides reached differs in prompt or output (as forks.sql). fork_rate is the mean
--       over episodes of the share of their samples that forked (k/n when each has one sample).
--     baseline_arm = ''   repeats of each configuration against each other: runs that served the
--       episodes in the same order (nothing but a rerun) should agree. An episode counts as forked
--       when two of its repeats differ: nondeterminism outside the cache. compared_with = arm.
--   ci_low / ci_high: 95 % interval over episodes (queries/shared/cluster_interval.sql): Wilson when
--   each episode is one yes/no sample, else a cluster bootstrap over episodes; interval_method says
--   which. median fork turn / position are over forked samples (NaN when none forked; position -1
--   when outputs could only be compared by hash or the fork was a prompt mismatch); mean_cached_tokens
--   is the mean reused prompt tokens per request over the configuration's runs.
--   Optional scope (what alert rules use): only requests with since <= Timestamp < until and the
--   given engine / model / weight format ('' = any).
-- params: run_prefix String = '', baseline_arm String = '', since DateTime64(3) = '1970-01-01 00:00:00',
--   until DateTime64(3) = '2200-01-01 00:00:00', engine String = '', model String = '',
--   weight_format String = ''
-- columns: engine, weight_format, kv_cache_type, numerics_settings, arm, cache_settings, compared_with,
--   runs, compared_runs, episodes_compared, samples, episodes_forked, fork_rate, ci_low, ci_high,
--   interval_method, median_fork_turn, median_fork_position, mean_cached_tokens
WITH
${shared_requests_once}
${shared_output_divergence}
${shared_wilson_interval}
${shared_cluster_interval}
${shared_request_scope}
scoped AS (
    SELECT Timestamp, run_id, episode_id, turn, prompt_hash, output_hash, token_ids, reused_tokens, engine,
           model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings
    FROM requests_once AS q
    WHERE startsWith(run_id, {run_prefix:String}) AND episode_id != ''
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)  -- columns, not the aggregates' aliases
),
requests AS (
    SELECT run_id, episode_id, turn, Timestamp, prompt_hash, output_hash, token_ids
    FROM scoped
    ORDER BY run_id, episode_id, turn, Timestamp
    LIMIT 1 BY run_id, episode_id, turn
),
-- One row per (run, episode): its trajectory, and when the run first served the episode.
trajectories AS (
    SELECT run_id, episode_id, min(Timestamp) AS first_seen,
           cityHash64(arraySort(groupArray((turn, prompt_hash, output_hash, token_ids)))) AS trajectory
    FROM requests
    GROUP BY run_id, episode_id
),
run_config AS (
    SELECT run_id, any(engine) AS engine, any(model_fingerprint) AS model_fingerprint,
           any(weight_format) AS weight_format, any(kv_cache_type) AS kv_cache_type,
           any(numerics_settings) AS numerics_settings, any(arm) AS arm, any(cache_settings) AS cache_settings
    FROM scoped
    GROUP BY run_id
),
-- The order a run served its episodes in: runs in the same order are repeats of each other.
run_orders AS (
    SELECT run_id, cityHash64(arrayMap(x -> x.2, arraySort(groupArray((first_seen, episode_id))))) AS episode_order
    FROM trajectories
    GROUP BY run_id
),
observed AS (
    SELECT c.engine AS engine, c.model_fingerprint AS model_fingerprint, c.weight_format AS weight_format,
           c.kv_cache_type AS kv_cache_type, c.numerics_settings AS numerics_settings, c.arm AS arm,
           c.cache_settings AS cache_settings, o.episode_order AS episode_order,
           t.run_id AS run_id, t.episode_id AS episode_id, t.trajectory AS trajectory
    FROM trajectories AS t
    INNER JOIN run_config AS c ON c.run_id = t.run_id
    INNER JOIN run_orders AS o ON o.run_id = t.run_id
),
-- Bit-identical observations of an episode collapse into one (any repeat, any order).
distinct_observed AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
           episode_id, trajectory, min(run_id) AS run_id
    FROM observed
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
             episode_id, trajectory
),
samples AS (
    SELECT a.engine AS engine, a.model_fingerprint AS model_fingerprint, a.weight_format AS weight_format,
           a.kv_cache_type AS kv_cache_type, a.numerics_settings AS numerics_settings, a.arm AS arm,
           a.cache_settings AS cache_settings, b.arm AS compared_with, a.episode_id AS episode_id,
           a.run_id AS run_a, b.run_id AS run_b
    FROM distinct_observed AS a
    INNER JOIN distinct_observed AS b
        ON a.engine = b.engine AND a.model_fingerprint = b.model_fingerprint AND a.weight_format = b.weight_format
       AND a.kv_cache_type = b.kv_cache_type AND a.numerics_settings = b.numerics_settings
       AND a.episode_id = b.episode_id
    WHERE {baseline_arm:String} != '' AND b.arm = {baseline_arm:String} AND a.arm != {baseline_arm:String}
    UNION ALL
    -- Repeats: every two runs of one configuration that served the episodes in the same order.
    SELECT a.engine, a.model_fingerprint, a.weight_format, a.kv_cache_type, a.numerics_settings, a.arm,
           a.cache_settings, a.arm, a.episode_id, a.run_id, b.run_id
    FROM observed AS a
    INNER JOIN observed AS b
        ON a.engine = b.engine AND a.model_fingerprint = b.model_fingerprint AND a.weight_format = b.weight_format
       AND a.kv_cache_type = b.kv_cache_type AND a.numerics_settings = b.numerics_settings AND a.arm = b.arm
       AND a.cache_settings = b.cache_settings AND a.episode_order = b.episode_order
       AND a.episode_id = b.episode_id
    WHERE {baseline_arm:String} = '' AND a.run_id < b.run_id
),
compared AS (
    SELECT s.engine AS engine, s.model_fingerprint AS model_fingerprint, s.weight_format AS weight_format,
           s.kv_cache_type AS kv_cache_type, s.numerics_settings AS numerics_settings, s.arm AS arm,
           s.cache_settings AS cache_settings, s.compared_with AS compared_with, s.episode_id AS episode_id,
           s.run_a AS run_a, s.run_b AS run_b, ta.turn AS turn,
           ta.prompt_hash != tb.prompt_hash
               OR outputs_differ(ta.token_ids, tb.token_ids, ta.output_hash, tb.output_hash) AS differs,
           fork_position(ta.prompt_hash, tb.prompt_hash, ta.token_ids, tb.token_ids, ta.output_hash,
                         tb.output_hash) AS position
    FROM samples AS s
    INNER JOIN requests AS ta ON ta.run_id = s.run_a AND ta.episode_id = s.episode_id
    INNER JOIN requests AS tb ON tb.run_id = s.run_b AND tb.episode_id = s.episode_id AND tb.turn = ta.turn
),
sample_forks AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
           compared_with, episode_id, run_a, run_b,
           max(differs) AS forked,
           argMinIf(turn, turn, differs) AS fork_turn,
           argMinIf(position, turn, differs) AS first_fork_position
    FROM compared
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
             compared_with, episode_id, run_a, run_b
),
episodes AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
           compared_with, episode_id,
           count() AS samples,
           -- repeats: one yes/no per episode (do any two differ?); arms: the share of samples that forked
           if({baseline_arm:String} = '', toFloat64(max(forked)), avg(forked)) AS forked_share,
           max(forked) AS any_forked,
           groupArrayIf(fork_turn, forked = 1) AS fork_turns,
           groupArrayIf(first_fork_position, forked = 1) AS fork_positions
    FROM sample_forks
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
             compared_with, episode_id
),
rates AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
           compared_with,
           count() AS episodes_compared,
           sum(samples) AS samples,
           sum(any_forked) AS episodes_forked,
           avg(forked_share) AS fork_rate,
           arrayMap(x -> x.2, arraySort(groupArray((episode_id, forked_share)))) AS shares,
           if(episodes_forked > 0, toFloat64(quantileExactArray(0.5)(fork_turns)), nan) AS median_fork_turn,
           if(episodes_forked > 0, toFloat64(quantileExactArray(0.5)(fork_positions)), nan) AS median_fork_position
    FROM episodes
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
             compared_with
),
configuration_runs AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
           uniqExact(run_id) AS runs
    FROM observed
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings
),
baseline_runs AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, uniqExact(run_id) AS runs
    FROM observed
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm
),
cached AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings,
           avg(reused_tokens) AS mean_cached_tokens
    FROM scoped
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings
)
SELECT
    r.engine AS engine, r.weight_format AS weight_format, r.kv_cache_type AS kv_cache_type,
    r.numerics_settings AS numerics_settings, r.arm AS arm, r.cache_settings AS cache_settings,
    r.compared_with AS compared_with,
    n.runs AS runs,
    if(r.compared_with = r.arm, n.runs, b.runs) AS compared_runs,
    r.episodes_compared AS episodes_compared,
    r.samples AS samples,
    r.episodes_forked AS episodes_forked,
    r.fork_rate AS fork_rate,
    rate_interval_low(r.shares, arrayMap(x -> 1., r.shares)) AS ci_low,
    rate_interval_high(r.shares, arrayMap(x -> 1., r.shares)) AS ci_high,
    rate_interval_method(r.shares, arrayMap(x -> 1., r.shares)) AS interval_method,
    r.median_fork_turn AS median_fork_turn,
    r.median_fork_position AS median_fork_position,
    c.mean_cached_tokens AS mean_cached_tokens
FROM rates AS r
LEFT JOIN configuration_runs AS n
    ON n.engine = r.engine AND n.model_fingerprint = r.model_fingerprint AND n.weight_format = r.weight_format
   AND n.kv_cache_type = r.kv_cache_type AND n.numerics_settings = r.numerics_settings AND n.arm = r.arm
   AND n.cache_settings = r.cache_settings
LEFT JOIN baseline_runs AS b
    ON b.engine = r.engine AND b.model_fingerprint = r.model_fingerprint AND b.weight_format = r.weight_format
   AND b.kv_cache_type = r.kv_cache_type AND b.numerics_settings = r.numerics_settings AND b.arm = r.compared_with
LEFT JOIN cached AS c
    ON c.engine = r.engine AND c.model_fingerprint = r.model_fingerprint AND c.weight_format = r.weight_format
   AND c.kv_cache_type = r.kv_cache_type AND c.numerics_settings = r.numerics_settings AND c.arm = r.arm
   AND c.cache_settings = r.cache_settings
ORDER BY engine, weight_format, kv_cache_type, numerics_settings, arm, cache_settings
