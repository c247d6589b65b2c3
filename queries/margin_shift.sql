-- answers: How much a cache hit moves the top-two margin, at matched positions.
--   Each request that reused cached state (reused_tokens > 0) is matched with a reference request
--   that recomputed the same prompt (same prompt_hash, engine, model fingerprint, weight format, KV
--   cache type and numerics settings; the earliest such request). Positions are matched while the
--   chosen tokens agree (same chosen prefix), up to and including the first differing position, where
--   both requests have a margin (queries/shared/matched_positions.sql).
--   shift = hit margin - recompute margin, in raw logits. Runs: those whose id starts with
--   run_prefix ('' = all). Outputs must carry token ids (ids or hashed capture). One row per weight
--   format plus a row '(all)'. Optional scope (what alert rules use): only cache-hit requests with
--   since <= Timestamp < until and the given engine / model / weight format ('' = any); the
--   reference recompute may be older than the window. reference_arm: only references of this arm
--   ('' = any; 'shadow' = the cold twins `kvtrace proxy --shadow` sends of live cache-hit requests).
--   shadow_pairs / shadow_episodes: how many of the pairs rest on a shadow twin, and from how many
--   distinct episodes. episodes: the distinct episodes of all the pairs (requests without one count
--   alone): the independent samples, since the pairs of one episode share its prompts and cache
--   history. ci_low / ci_high: 95 % interval of mean_abs_shift, a cluster bootstrap over those
--   episodes (queries/shared/cluster_interval.sql; one episode: both ends are its value). The
--   bootstrap is most of the query's time: interval = 0 leaves it out (ci_low, ci_high NaN), as alert
--   rules do, which read neither.
-- params: run_prefix String = '', since DateTime64(3) = '1970-01-01 00:00:00',
--   until DateTime64(3) = '2200-01-01 00:00:00', engine String = '', model String = '',
--   weight_format String = '', reference_arm String = '', interval UInt8 = 1
-- columns: weight_format, request_pairs, positions, mean_shift, mean_abs_shift, p50_abs_shift,
--   p95_abs_shift, max_abs_shift, shadow_pairs, shadow_episodes, episodes, ci_low, ci_high
WITH
${shared_requests_once}
(run) -> startsWith(run, {run_prefix:String}) AS in_runs,
${shared_wilson_interval}
${shared_cluster_interval}
${shared_output_divergence}
${shared_recompute_reference}
${shared_request_scope}
${shared_matched_positions}
hit_shifts AS (
    SELECT format, matched_positions, arrayMap((x, y) -> x - y, hit_margins, recompute_margins) AS shifts,
           reference_arm, if(episode_id != '', episode_id, prompt_hash) AS cluster
    FROM matched
    WHERE in_request_scope(hit_time, engine, model, format)
),
per_format AS (
    SELECT
        if(grouping(format) = 1, '(all)', format) AS weight_format,
        grouping(format) AS rollup,
        count() AS request_pairs,
        sum(matched_positions) AS positions,
        avgArray(shifts) AS mean_shift,
        avgArray(arrayMap(x -> abs(x), shifts)) AS mean_abs_shift,
        -- both levels from one selection over the shifts; NaN when there are none, as a single level gives
        if(positions > 0, quantilesExactArray(0.5, 0.95)(arrayMap(x -> abs(x), shifts))[1], nan) AS p50_abs_shift,
        if(positions > 0, quantilesExactArray(0.5, 0.95)(arrayMap(x -> abs(x), shifts))[2], nan) AS p95_abs_shift,
        maxArray(arrayMap(x -> abs(x), shifts)) AS max_abs_shift,
        countIf(reference_arm = '${ARM_SHADOW}') AS shadow_pairs,
        uniqExactIf(cluster, reference_arm = '${ARM_SHADOW}') AS shadow_episodes,
        uniqExact(cluster) AS episodes
    FROM hit_shifts
    GROUP BY GROUPING SETS ((format), ())
),
per_episode AS (
    -- each episode once per row of the answer: its |shift| sum over its matched positions
    SELECT if(grouping(format) = 1, '(all)', format) AS weight_format, cluster,
           sum(arraySum(arrayMap(x -> abs(x), shifts))) AS abs_sum, sum(matched_positions) AS matched
    FROM hit_shifts
    WHERE {interval:UInt8} = 1
    GROUP BY GROUPING SETS ((format, cluster), (cluster))
    HAVING matched > 0
),
intervals AS (
    SELECT weight_format, cluster_bootstrap_rates(
               arrayMap(c -> c.2, arraySort(groupArray((cluster, abs_sum)))),
               arrayMap(c -> c.2, arraySort(groupArray((cluster, matched))))) AS draws
    FROM per_episode
    GROUP BY weight_format
)
SELECT f.weight_format AS weight_format, request_pairs, positions, mean_shift, mean_abs_shift, p50_abs_shift,
       p95_abs_shift, max_abs_shift, shadow_pairs, shadow_episodes, episodes,
       if(notEmpty(i.draws), i.draws[50], nan) AS ci_low, if(notEmpty(i.draws), i.draws[1951], nan) AS ci_high
FROM per_format AS f
LEFT JOIN intervals AS i ON i.weight_format = f.weight_format
ORDER BY rollup, weight_format
SETTINGS join_use_nulls = 0
