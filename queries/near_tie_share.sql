-- answers: How many decisions on cache-hit paths are near ties (top-1 − top-2 margin below near_tie).
--   Over requests that reused cached state (reused_tokens > 0) in the scope (since <= Timestamp <
--   until, engine / model / weight format filters, '' = any; runs whose id starts with run_prefix),
--   the share of generated positions whose margin is below near_tie raw logits: the decisions a cache
--   path can plausibly flip (see fork_attribution.sql for the default 0.05). One row per engine,
--   model and weight format. Requests recorded without margins are not counted.
-- params: near_tie Float64 = 0.05, run_prefix String = '', since DateTime64(3) = '1970-01-01 00:00:00',
--   until DateTime64(3) = '2200-01-01 00:00:00', engine String = '', model String = '',
--   weight_format String = ''
-- columns: engine, model, weight_format, requests, positions, near_ties, near_tie_share
WITH
${shared_requests_once}
(run) -> startsWith(run, {run_prefix:String}) AS in_runs,
${shared_request_scope}
hits AS (
    SELECT q.engine AS engine, q.model AS model, q.weight_format AS weight_format,
           length(q.margins) AS n, arrayCount(m -> m < {near_tie:Float64}, q.margins) AS ties
    FROM requests_once AS q
    WHERE startsWith(q.run_id, {run_prefix:String}) AND q.reused_tokens > 0 AND notEmpty(q.margins)
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)
)
SELECT
    engine, model, weight_format,
    count() AS requests,
    sum(n) AS positions,
    sum(ties) AS near_ties,
    near_ties / positions AS near_tie_share
FROM hits
GROUP BY engine, model, weight_format
ORDER BY engine, model, weight_format
