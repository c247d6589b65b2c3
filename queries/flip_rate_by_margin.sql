-- answers: How often the top-1 token flips between a cache hit and a recompute, by margin.
--   Matched positions as in margin_shift.sql (a cache-hit request against the earliest request that
--   recomputed the same prompt under the same engine, model, weight format, KV cache type and
--   numerics; positions while the chosen prefix agrees, up to the first differing one, where both
--   requests have a margin: queries/shared/matched_positions.sql). A position flips when the
--   raw-logit arg-max differs (top1_ids; chosen token_ids when top-1 ids are absent).
--   Binned by the recompute path's margin: [0,0.1), [0.1,0.3), [0.3,1), >=1 raw logits
--   (semconv.MARGIN_BIN_EDGES, queries/shared/margin_bins.sql); with a Wilson score 95 % interval.
--   Rows per weight format and bin, plus weight_format '(all)'.
-- params: run_prefix String = ''
-- columns: weight_format, margin_bin, positions, flips, flip_rate, ci_low, ci_high
WITH
${shared_requests_once}
${shared_output_divergence}
${shared_wilson_interval}
${shared_margin_bins}
${shared_recompute_reference}
${shared_matched_positions}
positions AS (
    SELECT format, flip, margin, margin_bin_of(margin) AS margin_bin
    FROM matched
    ARRAY JOIN arrayMap((x, y) -> x != y, hit_top_ids, recompute_top_ids) AS flip,
               recompute_margins AS margin
),
binned AS (
    SELECT
        if(grouping(format) = 1, '(all)', format) AS weight_format,
        margin_bin,
        count() AS positions,
        sum(flip) AS flips,
        min(margin) AS bin_floor
    FROM positions
    GROUP BY GROUPING SETS ((format, margin_bin), (margin_bin))
)
SELECT
    weight_format, margin_bin, positions, flips,
    flips / positions AS flip_rate,
    wilson_low(flip_rate, positions) AS ci_low,
    wilson_high(flip_rate, positions) AS ci_high
FROM binned
ORDER BY weight_format = '(all)', weight_format, bin_floor
