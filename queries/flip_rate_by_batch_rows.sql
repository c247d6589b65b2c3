-- answers: How often the top-1 token flips between two runs of the same requests, by how differently
--   the engine batched them (docs/batching.md).
--   Each request of run A is paired with run B's request of the same episode, turn and prompt (the first
--   of each, as forks.sql pairs them), where both recorded their batch composition and took the same
--   cache path (the same reused tokens): what differs is how they were batched. Positions are compared
--   while the chosen tokens agree, up to and including the first differing one (as margin_shift's matched
--   positions); one flips when the raw-logit arg-max differs (top1_ids; chosen token_ids when absent).
--   Binned by the difference in rows of the two steps that computed the position: 0, 1, 2-3, 4-7, >=8
--   (semconv.BATCH_ROWS_BIN_EDGES); a pair whose prompts were split into other steps has every position
--   in bin BATCH_BIN_PREFILL_SPLIT instead, since its whole context was computed differently. Positions of one
--   episode are not independent: the interval is a cluster bootstrap over episodes
--   (queries/shared/cluster_interval.sql).
-- params: run_a String, run_b String
-- columns: rows_difference, episodes, positions, flips, flip_rate, ci_low, ci_high, interval_method
WITH
${shared_requests_once}
(run) -> run IN ({run_a:String}, {run_b:String}) AS in_runs,
${shared_output_divergence}
${shared_wilson_interval}
${shared_cluster_interval}
side AS (
    SELECT run_id, episode_id, turn, prompt_hash, reused_tokens, token_ids,
           if(notEmpty(top1_ids), top1_ids, token_ids) AS top_ids, step_rows, prefill_steps
    FROM requests_once
    WHERE run_id IN ({run_a:String}, {run_b:String}) AND episode_id != '' AND notEmpty(token_ids)
      AND batch_composition = '${BATCH_RECORDED}'
    ORDER BY run_id, episode_id, turn, Timestamp
    LIMIT 1 BY run_id, episode_id, turn
),
pairs AS (
    SELECT a.episode_id AS episode_id,
           first_mismatch_index(a.token_ids, b.token_ids) AS first_mismatch,
           least(if(first_mismatch > 0, first_mismatch, least(length(a.token_ids), length(b.token_ids))),
                 length(a.step_rows), length(b.step_rows)) AS compared,
           a.prefill_steps != b.prefill_steps AS split_differs,
           arraySlice(a.top_ids, 1, compared) AS top_a, arraySlice(b.top_ids, 1, compared) AS top_b,
           arraySlice(a.step_rows, 1, compared) AS rows_a, arraySlice(b.step_rows, 1, compared) AS rows_b
    FROM (SELECT * FROM side WHERE run_id = {run_a:String}) AS a
    INNER JOIN (SELECT * FROM side WHERE run_id = {run_b:String}) AS b
        ON a.episode_id = b.episode_id AND a.turn = b.turn AND a.prompt_hash = b.prompt_hash
    WHERE a.reused_tokens = b.reused_tokens
),
clusters AS (
    SELECT if(split_differs, '${BATCH_BIN_PREFILL_SPLIT}',
              ${BATCH_ROWS_BIN_LABELS}[arrayCount(edge -> NOT (abs(row_a - row_b) < edge), ${BATCH_ROWS_BIN_EDGES}) + 1])
               AS rows_difference,
           episode_id, count() AS positions, countIf(x != y) AS flips
    FROM pairs
    ARRAY JOIN top_a AS x, top_b AS y, rows_a AS row_a, rows_b AS row_b
    GROUP BY rows_difference, episode_id
),
binned AS (
    SELECT rows_difference, count() AS episodes, sum(positions) AS positions_total, sum(flips) AS flips_total,
           arrayMap(x -> toFloat64(x.2), arraySort(groupArray((episode_id, flips, positions)))) AS cluster_flips,
           arrayMap(x -> toFloat64(x.3), arraySort(groupArray((episode_id, flips, positions)))) AS cluster_positions
    FROM clusters
    GROUP BY rows_difference
)
SELECT rows_difference, episodes, positions_total AS positions, flips_total AS flips,
       flips_total / positions_total AS flip_rate,
       rate_interval_low(cluster_flips, cluster_positions) AS ci_low,
       rate_interval_high(cluster_flips, cluster_positions) AS ci_high,
       rate_interval_method(cluster_flips, cluster_positions) AS interval_method
FROM binned
ORDER BY indexOf(arrayPushBack(${BATCH_ROWS_BIN_LABELS}, '${BATCH_BIN_PREFILL_SPLIT}'), rows_difference)
