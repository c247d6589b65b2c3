-- answers: How often the top-1 token flips between a cache hit and a recompute, by margin.
--   Matched positions as in margin_shift.sql (a cache-hit request against the earliest request that
--   recomputed the same prompt under the same engine, model, weight format, KV cache type and
--   numerics; positions while the chosen prefix agrees, up to the first differing one, where both
--   requests have a margin: queries/shared/matched_positions.sql). A position flips when the
--   raw-logit arg-max differs (top1_ids; chosen token_ids when top-1 ids are absent).
--   Each distinct position — (episode, turn, prompt, position) under one configuration — counts
--   once, however many runs repeated it; it flipped when any cache hit at it flipped. Binned by the
--   recompute path's margin: [0,0.1), [0.1,0.3), [0.3,1), >=1 raw logits (semconv.MARGIN_BIN_EDGES,
--   queries/shared/margin_bins.sql). Positions of one episode are not independent: the interval is
--   a cluster bootstrap over episodes (queries/shared/cluster_interval.sql; Wilson only when every
--   episode holds a single position; requests without an episode are their own cluster).
--   Rows per weight format, KV cache type, numerics settings and bin, plus weight_format '(all)'
--   (KV type and numerics '') per bin.
--   reference_arm: only recompute references of this arm ('' = any; 'shadow' = the proxy's cold twins
--   of live requests, `kvtrace proxy --shadow`).
-- params: run_prefix String = '', reference_arm String = ''
-- columns: weight_format, kv_cache_type, numerics_settings, margin_bin, episodes, positions, flips,
--   flip_rate, ci_low, ci_high, interval_method
WITH
${shared_requests_once}
(run) -> startsWith(run, {run_prefix:String}) AS in_runs,
${shared_output_divergence}
${shared_wilson_interval}
${shared_cluster_interval}
${shared_margin_bins}
${shared_recompute_reference}
${shared_matched_positions}
positions AS (
    SELECT format, kv_cache_type, numerics_settings, if(episode_id != '', episode_id, prompt_hash) AS cluster,
           turn, prompt_hash, position, max(flip) AS flipped, any(margin) AS margin
    FROM matched
    ARRAY JOIN arrayMap((x, y) -> x != y, hit_top_ids, recompute_top_ids) AS flip,
               recompute_margins AS margin,
               arrayEnumerate(recompute_margins) AS position
    GROUP BY format, kv_cache_type, numerics_settings, cluster, turn, prompt_hash, position
),
clusters AS (
    SELECT format, kv_cache_type, numerics_settings, margin_bin_of(margin) AS margin_bin, cluster,
           count() AS positions, sum(flipped) AS flips, min(margin) AS bin_floor
    FROM positions
    GROUP BY format, kv_cache_type, numerics_settings, margin_bin, cluster
),
-- An episode is one cluster in the '(all)' rows too, whatever configurations it ran under.
all_clusters AS (
    SELECT '(all)' AS format, '' AS kv_cache_type, '' AS numerics_settings, margin_bin, cluster,
           sum(positions) AS positions, sum(flips) AS flips, min(bin_floor) AS bin_floor
    FROM clusters
    GROUP BY margin_bin, cluster
),
binned AS (
    SELECT
        format AS weight_format, kv_cache_type AS kv_type, numerics_settings AS numerics, margin_bin,
        count() AS episodes,
        sum(positions) AS positions_total,
        sum(flips) AS flips_total,
        arrayMap(x -> toFloat64(x.2), arraySort(groupArray((cluster, flips, positions)))) AS cluster_flips,
        arrayMap(x -> toFloat64(x.3), arraySort(groupArray((cluster, flips, positions)))) AS cluster_positions,
        min(bin_floor) AS floor
    FROM (SELECT * FROM clusters UNION ALL SELECT * FROM all_clusters)
    GROUP BY format, kv_cache_type, numerics_settings, margin_bin
)
SELECT
    weight_format, kv_type AS kv_cache_type, numerics AS numerics_settings, margin_bin, episodes,
    positions_total AS positions, flips_total AS flips,
    flips_total / positions_total AS flip_rate,
    rate_interval_low(cluster_flips, cluster_positions) AS ci_low,
    rate_interval_high(cluster_flips, cluster_positions) AS ci_high,
    rate_interval_method(cluster_flips, cluster_positions) AS interval_method
FROM binned
ORDER BY weight_format = '(all)', weight_format, kv_cache_type, numerics_settings, floor
