-- answers: How often episodes fork, per configuration, counting each distinct episode once.
--   A configuration is the engine, model, weight format, KV cache type and numerics settings (batch
--   sizes, flash attention, threads...), plus the arm and its cache settings (e.g. the prompt cache's
--   capacity). An episode's trajectory in a run is every turn's prompt and output; runs whose
--   trajectories of an episode are bit-identical are one observation of it, not several.
--   A run's arms are observed apart: the cold twins `kvtrace proxy --shadow` sends share their
--   originals' run (arm shadow).
--   Rows, for the runs whose id starts with run_prefix ('' = every run):
--     baseline_arm = ARM  every other arm against ARM under the same engine, model, format, KV type and
--       numerics (does caching change the outcome?). The samples of an episode are its distinct
--       (trajectory, baseline trajectory) pairs: one when every repeat and order of the arm agrees
--       with itself, more when orders (or repeats) give different trajectories. A sample forked when
--       some turn both sides reached differs in prompt or output (as forks.sql). fork_rate is the mean
--       over episodes of the share of their samples that forked (k/n when each has one sample).
--     baseline_arm = 'shadow'   live requests against their cold twins: a sample forked when a twin's
--       output differs from its original's. A request without an episode id (no baggage) is an episode
--       of its own here, its twin's by the parent span.
--     baseline_arm = ''   repeats of each configuration against each other: runs that served the
--       episodes in the same order (nothing but a rerun) should agree. An episode counts as forked
--       when two of its repeats differ: nondeterminism outside the cache. compared_with = arm.
--   ci_low / ci_high: 95 % interval over episodes (queries/shared/cluster_interval.sql): Wilson when
--   each episode is one yes/no sample, else a cluster bootstrap over episodes; interval_method says
--   which. median fork turn / position are over forked samples (NaN when none forked; position -1
--   when outputs could only be compared by hash or the fork was a prompt mismatch); mean_cached_tokens
--   is the mean reused prompt tokens per request over the configuration's runs.
--   A request its client cancelled (finish_reason cancelled) is left out: its output is not the engine's
--   whole answer, so its turn is not compared (the episode's other turns are).
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
(run) -> startsWith(run, {run_prefix:String}) AS in_runs,
${shared_output_divergence}
${shared_wilson_interval}
${shared_cluster_interval}
${shared_request_scope}
scoped AS (
    SELECT Timestamp, run_id,
           if(q.episode_id = '' AND {baseline_arm:String} = '${ARM_SHADOW}',
              concat('request:', if(q.arm = '${ARM_SHADOW}', q.ParentSpanId, q.SpanId)), q.episode_id) AS episode_id,
           turn, SpanId, prompt_hash, output_hash, notEmpty(token_ids) AS has_ids,
           token_digest, reused_tokens, engine,
           model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings
    FROM requests_once AS q
    WHERE (q.episode_id != '' OR {baseline_arm:String} = '${ARM_SHADOW}')  -- the runs: in_runs
      AND q.finish_reason != '${FINISH_CANCELLED}'
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)  -- columns, not the aggregates' aliases
),
requests AS (
    -- the pairing below only compares these for equality, and 8-byte keys move through its groupings and
    -- arrays cheaper than hex text (0.84x CPU at 12.8M token rows)
    SELECT run_id, arm, episode_id, turn, Timestamp, cityHash64(prompt_hash) AS prompt_key,
           cityHash64(output_hash) AS output_key, has_ids, token_digest, reinterpretAsUInt64(unhex(SpanId)) AS span_key,
           (engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings)
               AS configuration
    FROM scoped
    ORDER BY run_id, arm, episode_id, turn, Timestamp
    LIMIT 1 BY run_id, arm, episode_id, turn
),
-- ClickHouse plans a WITH subquery again wherever it is referenced, and planning, not reading, is what
-- this query spends its time on: each subquery below is referenced once (scoped aside: requests and
-- cached read it), the runs are paired per episode with arrays instead of self-joins, each run's turns
-- ride along with its trajectory rather than being joined in again, and what a run is (its configuration,
-- the order it served its episodes in) comes from its episodes' rows by window functions. A turn's
-- output rides as its token_digest (queries/shared/output_divergence.sql); the token arrays are read
-- again only for the turns where samples fork, for the position.
-- One row per (run, arm, episode): its turns in order (turn, prompt key, output key, has ids, token digest,
-- span key), its trajectory (the turns without their span ids) and when the run first served it.
trajectories AS (
    SELECT run_id, arm, episode_id,
           arraySort(groupArray((turn, prompt_key, output_key, has_ids, token_digest, span_key))) AS turns,
           cityHash64(arrayMap(t -> (t.1, t.2, t.3, t.5), turns)) AS trajectory,
           min(Timestamp) AS first_served,
           any(configuration) AS episode_configuration
    FROM requests
    GROUP BY run_id, arm, episode_id
),
-- The run's configuration, and the order it served its episodes in (by each one's first request: runs in
-- the same order are repeats of each other) as a sum of hashes of (rank, episode).
run_observations AS (
    SELECT run_id, episode_id, trajectory, turns,
           any(episode_configuration) OVER run AS configuration,
           sum(cityHash64(served_rank, episode_id)) OVER run AS episode_order
    FROM (SELECT *, row_number() OVER (PARTITION BY run_id, arm ORDER BY first_served, episode_id) AS served_rank
          FROM trajectories)
    WINDOW run AS (PARTITION BY run_id, arm)
),
-- configuration_runs / arm_runs: how many runs the configuration / its arm (cache settings aside) has.
observed AS (
    SELECT configuration.1 AS engine, configuration.2 AS model_fingerprint, configuration.3 AS weight_format,
           configuration.4 AS kv_cache_type, configuration.5 AS numerics_settings, configuration.6 AS arm,
           configuration.7 AS cache_settings, episode_order,
           uniqExact(run_id) OVER (PARTITION BY configuration) AS configuration_runs,
           uniqExact(run_id) OVER (PARTITION BY tupleElement(configuration, 1), tupleElement(configuration, 2),
                                   tupleElement(configuration, 3), tupleElement(configuration, 4),
                                   tupleElement(configuration, 5), tupleElement(configuration, 6)) AS arm_runs,
           run_id, episode_id, trajectory, turns
    FROM run_observations
),
-- Per episode and configuration (arms aside), every run's observation, sorted:
-- seen (arm, cache_settings, trajectory, run_id, episode_order, configuration_runs, arm_runs) and, at the
-- same index, seen_turns (its turns). The pairing below handles indexes into them: an array a lambda
-- reads is copied for each element it is applied to, and the turns are the bulk.
episode_observations AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, episode_id,
           groupArray((arm, cache_settings, trajectory, run_id, episode_order, configuration_runs, arm_runs))
               AS observations,
           arraySort(observations) AS seen,
           arraySort((t, o) -> o, groupArray(turns), observations) AS seen_turns
    FROM observed
    GROUP BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, episode_id
),
-- The pairs compared (indexes of side a, side b). Against a baseline arm: bit-identical observations of
-- an arm collapse into one (any repeat, any order; its first run stands for it), and every other arm's
-- meets the baseline's. Repeats: every two runs of one arm and cache settings that served the episodes
-- in the same order.
samples AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, episode_id,
           seen[pair.1].1 AS arm, seen[pair.1].2 AS cache_settings, seen[pair.2].1 AS compared_with,
           seen[pair.1].4 AS run_a, seen[pair.2].4 AS run_b, seen[pair.1].6 AS configuration_runs,
           seen[pair.2].7 AS compared_arm_runs, seen_turns[pair.1] AS turns_a, seen_turns[pair.2] AS turns_b
    FROM (
        SELECT *,
               arrayFilter(i -> i = 1
                                OR (seen[i].1, seen[i].2, seen[i].3) != (seen[i - 1].1, seen[i - 1].2, seen[i - 1].3),
                           arrayEnumerate(seen)) AS distinct_at
        FROM episode_observations
    )
    ARRAY JOIN if({baseline_arm:String} != '',
        arrayFlatten(arrayMap(a -> arrayMap(b -> (a, b),
                                            arrayFilter(b -> seen[b].1 = {baseline_arm:String}, distinct_at)),
                              arrayFilter(a -> seen[a].1 != {baseline_arm:String}, distinct_at))),
        arrayFlatten(arrayMap(a -> arrayMap(b -> (a, b),
                                            arrayFilter(b -> seen[b].1 = seen[a].1 AND seen[b].2 = seen[a].2
                                                             AND seen[b].5 = seen[a].5 AND seen[a].4 < seen[b].4,
                                                        arrayEnumerate(seen))),
                              arrayEnumerate(seen)))) AS pair
),
-- Per sample, every turn both sides reached (both sorted by turn, so the common turns line up), in order:
-- whether it differs (prompt or output, as forks.sql), and at the first that does, the turn and both sides'
-- requests. A sample without a common turn is not one.
sample_forks AS (
    SELECT * EXCEPT (turns_a, turns_b, numbers_a, numbers_b, common_a, common_b, differs),
           toUInt8(arrayExists(d -> d, differs)) AS forked,
           arrayFirstIndex(d -> d, differs) AS first,
           common_a[first].1 AS fork_turn,
           (common_a[first].2, common_b[first].2) AS fork_prompts,
           if(forked = 1, common_a[first].6, 0) AS fork_span_a,
           if(forked = 1, common_b[first].6, 0) AS fork_span_b
    FROM (
        SELECT *,
               arrayMap(t -> t.1, turns_a) AS numbers_a,
               arrayMap(t -> t.1, turns_b) AS numbers_b,
               arrayFilter((t, n) -> has(numbers_b, n), turns_a, numbers_a) AS common_a,
               arrayFilter((t, n) -> has(numbers_a, n), turns_b, numbers_b) AS common_b,
               arrayMap((a, b) -> a.2 != b.2 OR digests_differ(a.4, b.4, a.5, b.5, a.3, b.3), common_a, common_b)
                   AS differs
        FROM samples
    )
    WHERE notEmpty(common_a)
),
-- The forking turns' token arrays (each request's in scope, streamed past the samples; a span by its run
-- and id) and the position there.
-- configuration: the grouping key as one tuple (the analyzer resolves a key of nine columns through these
-- subqueries at several times the cost of one).
sample_positions AS (
    SELECT * EXCEPT (ids_a, ids_b),
           fork_position(fork_prompts.1, fork_prompts.2, ids_a, ids_b) AS first_fork_position,
           (engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings)
               AS configuration
    FROM (
        SELECT s.*, x.token_ids AS ids_b
        FROM (SELECT run_id, reinterpretAsUInt64(unhex(SpanId)) AS span_key, token_ids FROM kvtrace_requests FINAL
              WHERE startsWith(run_id, {run_prefix:String})) AS x
        RIGHT JOIN (
            SELECT s.*, x.token_ids AS ids_a
            FROM (SELECT run_id, reinterpretAsUInt64(unhex(SpanId)) AS span_key, token_ids FROM kvtrace_requests FINAL
                  WHERE startsWith(run_id, {run_prefix:String})) AS x
            RIGHT JOIN sample_forks AS s ON x.run_id = s.run_a AND x.span_key = s.fork_span_a
        ) AS s ON x.run_id = s.run_b AND x.span_key = s.fork_span_b
    )
),
episodes AS (
    SELECT configuration, compared_with, episode_id,
           count() AS samples,
           -- repeats: one yes/no per episode (do any two differ?); arms: the share of samples that forked
           if({baseline_arm:String} = '', toFloat64(max(forked)), avg(forked)) AS forked_share,
           max(forked) AS any_forked,
           groupArrayIf(fork_turn, forked = 1) AS fork_turns,
           groupArrayIf(first_fork_position, forked = 1) AS fork_positions,
           any(configuration_runs) AS configuration_runs,
           any(compared_arm_runs) AS compared_arm_runs
    FROM sample_positions
    GROUP BY configuration, compared_with, episode_id
),
rates AS (
    SELECT configuration, compared_with,
           count() AS episodes_compared,
           sum(samples) AS samples,
           sum(any_forked) AS episodes_forked,
           avg(forked_share) AS fork_rate,
           arrayMap(x -> x.2, arraySort(groupArray((episode_id, forked_share)))) AS shares,
           if(episodes_forked > 0, toFloat64(quantileExactArray(0.5)(fork_turns)), nan) AS median_fork_turn,
           if(episodes_forked > 0, toFloat64(quantileExactArray(0.5)(fork_positions)), nan) AS median_fork_position,
           any(configuration_runs) AS runs,
           any(compared_arm_runs) AS compared_arm_runs
    FROM episodes
    GROUP BY configuration, compared_with
),
cached AS (
    SELECT configuration, avg(reused_tokens) AS mean_cached_tokens
    FROM (SELECT (engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, arm, cache_settings)
                     AS configuration, reused_tokens
          FROM scoped)
    GROUP BY configuration
)
SELECT
    r.configuration.1 AS engine, r.configuration.3 AS weight_format, r.configuration.4 AS kv_cache_type,
    r.configuration.5 AS numerics_settings, r.configuration.6 AS arm, r.configuration.7 AS cache_settings,
    r.compared_with AS compared_with,
    r.runs AS runs,
    if(r.compared_with = r.configuration.6, r.runs, r.compared_arm_runs) AS compared_runs,
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
LEFT JOIN cached AS c ON c.configuration = r.configuration
ORDER BY engine, weight_format, kv_cache_type, numerics_settings, arm, cache_settings
-- a missing array from the joins that fetch the forking turns' tokens reads as empty, as the lambdas expect;
-- with merged expression steps the plan runs slower from the first subquery on and fuses those two joins
-- into one (0.83x the CPU without, at 12.8M token rows; fork_attribution is faster with them)
SETTINGS join_use_nulls = 0, query_plan_merge_expressions = 0
