-- CTE `requests_once`: kvtrace_requests with every request once. A request that `kvtrace probe`
-- sent to a server kvtrace traces is recorded twice: by the probe, from outside (it sets
-- reused_tokens_source: where its reused-token count came from), and by the engine, as a child span
-- of the probe's in the same trace. The engine's record, with the cache provenance and raw-logit
-- margins, stands for the request; the probe's record of it is left out. A probe's record with no
-- engine child (an untraced server) and an imported log stay. Every saved query reads requests
-- through it. The traces searched are only those that hold records made outside an engine. The table is
-- read FINAL, so a span stored twice is one request; the subqueries only test membership, where a copy
-- changes nothing. Needs `in_runs(run_id)`, a WITH lambda naming the runs the query reads
-- (`(run) -> true AS in_runs` for every run): they are chosen where the table is read, the subqueries'
-- reads too (the engine records a probed request in the probe's run), so the primary key skips the
-- other runs' rows whatever plan the query gets, and a query of some runs costs the same in a database
-- of any size.
requests_once AS (
    SELECT *, token_digest  -- a MATERIALIZED column: not in *
    FROM kvtrace_requests FINAL
    WHERE in_runs(run_id)
      AND (reused_tokens_source = ''
           OR (TraceId, SpanId) NOT IN (
               SELECT TraceId, ParentSpanId
               FROM kvtrace_requests
               WHERE in_runs(run_id) AND reused_tokens_source = '' AND ParentSpanId != ''
                 AND TraceId IN (SELECT TraceId FROM kvtrace_requests
                                 WHERE in_runs(run_id) AND reused_tokens_source != '')))
),
