-- answers: How many cache integrity violations the requests in scope met (the alert metric).
--   Over requests that continued from cached state (reused_tokens > 0) or met a violation (a server
--   may report no cached tokens for a state it did use) in the scope (since <=
--   Timestamp < until, engine / model / weight format filters, '' = any; runs whose id starts with
--   run_prefix): how many there were, and how many kvtrace.cache.integrity_violation events they
--   carry (a state not their prompt's own prefix; integrity_violations.sql lists them). One row per
--   engine, model and weight format.
-- params: run_prefix String = '', since DateTime64(3) = '1970-01-01 00:00:00',
--   until DateTime64(3) = '2200-01-01 00:00:00', engine String = '', model String = '',
--   weight_format String = ''
-- columns: engine, model, weight_format, requests, violations
WITH
${shared_requests_once}
(run) -> startsWith(run, {run_prefix:String}) AS in_runs,
${shared_request_scope}
violated AS (
    SELECT SpanId, uniqExact(event_index) AS events  -- each event once, however many copies were stored
    FROM kvtrace_cache_events
    WHERE event = '${EVENT_CACHE_INTEGRITY_VIOLATION}' AND startsWith(run_id, {run_prefix:String})
    GROUP BY SpanId
),
at_risk AS (
    SELECT q.SpanId AS SpanId, q.engine AS engine, q.model AS model, q.weight_format AS weight_format
    FROM requests_once AS q
    WHERE startsWith(q.run_id, {run_prefix:String}) AND (q.reused_tokens > 0 OR q.SpanId IN (SELECT SpanId FROM violated))
      AND in_request_scope(q.Timestamp, q.engine, q.model, q.weight_format)
)
SELECT
    r.engine AS engine, r.model AS model, r.weight_format AS weight_format,
    count() AS requests,
    sum(v.events) AS violations
FROM at_risk AS r
LEFT JOIN violated AS v ON v.SpanId = r.SpanId
GROUP BY engine, model, weight_format
ORDER BY engine, model, weight_format
SETTINGS join_use_nulls = 0
