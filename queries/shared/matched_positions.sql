-- CTE `matched`: each cache-hit request (reused_tokens > 0, token ids captured) of the runs whose id
-- starts with run_prefix, paired with its recompute reference (CTE `recomputed`), and the positions
-- where the two are compared. A position is matched while the chosen tokens agree (same chosen
-- prefix), up to and including the first differing position, and only where both requests have a
-- margin. Shared by margin_shift and flip_rate_by_margin, which must compare the same positions.
-- Needs shared_requests_once, shared_output_divergence and shared_recompute_reference before it, and params
-- run_prefix and reference_arm.
--   format, hit_time, engine, model: the cache-hit request's (for grouping and scope filters)
--   kv_cache_type, numerics_settings, episode_id, turn, prompt_hash: the cache-hit request's (to count
--     each distinct position once, and to cluster positions by episode)
--   reference_arm: the recompute reference's arm ('shadow': a proxy's cold twin of a live request)
--   matched_positions: how many positions are matched (from the first)
--   hit_margins, recompute_margins: both margins per matched position (raw logits)
--   hit_top_ids, recompute_top_ids: raw-logit arg-max per matched position (chosen ids when absent)
matched AS (
    SELECT
        h.weight_format AS format,
        h.Timestamp AS hit_time,
        h.engine AS engine,
        h.model AS model,
        h.kv_cache_type AS kv_cache_type,
        h.numerics_settings AS numerics_settings,
        h.episode_id AS episode_id,
        h.turn AS turn,
        h.prompt_hash AS prompt_hash,
        r.arm AS reference_arm,
        first_mismatch_index(h.token_ids, r.token_ids) AS first_mismatch,
        least(if(first_mismatch > 0, first_mismatch, least(length(h.token_ids), length(r.token_ids))),
              length(h.margins), length(r.margins)) AS matched_positions,
        arraySlice(h.margins, 1, matched_positions) AS hit_margins,
        arraySlice(r.margins, 1, matched_positions) AS recompute_margins,
        arraySlice(if(notEmpty(h.top1_ids), h.top1_ids, h.token_ids), 1, matched_positions) AS hit_top_ids,
        arraySlice(r.top_ids, 1, matched_positions) AS recompute_top_ids
    FROM requests_once AS h
    INNER JOIN recomputed AS r
        ON h.engine = r.engine AND h.model_fingerprint = r.model_fingerprint
       AND h.weight_format = r.weight_format AND h.kv_cache_type = r.kv_cache_type
       AND h.numerics_settings = r.numerics_settings AND h.prompt_hash = r.prompt_hash
    WHERE startsWith(h.run_id, {run_prefix:String}) AND h.reused_tokens > 0 AND notEmpty(h.token_ids)
),
