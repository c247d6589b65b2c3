-- CTE `recomputed`: per prompt, the earliest request that recomputed it (no cached tokens) under the
-- same engine, model, weight format, KV cache type and numerics settings, with token ids captured,
-- and of arm reference_arm when that is not '' ('shadow': the proxy's cold twins of live requests).
-- The reference that margin_shift and flip_rate_by_margin compare cache-hit requests against
-- (join on all six keys). top_ids: raw-logit arg-max per position (chosen ids when absent). Needs
-- shared_requests_once before it, and params run_prefix and reference_arm.
recomputed AS (
    SELECT engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, prompt_hash,
           token_ids, if(notEmpty(top1_ids), top1_ids, token_ids) AS top_ids, margins, arm
    FROM requests_once
    WHERE startsWith(run_id, {run_prefix:String}) AND reused_tokens = 0 AND notEmpty(token_ids)
      AND ({reference_arm:String} = '' OR arm = {reference_arm:String})
    ORDER BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, prompt_hash, Timestamp
    LIMIT 1 BY engine, model_fingerprint, weight_format, kv_cache_type, numerics_settings, prompt_hash
),
