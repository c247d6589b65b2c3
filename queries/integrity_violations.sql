-- answers: Which requests continued from a cached state that was not their own prompt's prefix.
--   One row per kvtrace.cache.integrity_violation event: the request (run, episode, turn, request id,
--   its span), the cache that served the state (layer), how the mismatch was found (reason:
--   tokens_differ, hash_chain_differs, cached_count_differs, foreign_prompt), how many tokens the
--   engine took from the state (used_tokens) and how many of those were the prompt's own
--   (matched_tokens), and the state's origin: the request that stored it (source_*; empty where
--   unknown). Scope: runs whose id starts with run_prefix (or exactly run), since <= Timestamp <
--   until, engine ('' = any). Newest first.
-- params: run String = '', run_prefix String = '', since DateTime64(3) = '1970-01-01 00:00:00',
--   until DateTime64(3) = '2200-01-01 00:00:00', engine String = ''
-- columns: Timestamp, run_id, episode_id, turn, request_id, span_id, trace_id, engine, layer, reason,
--   used_tokens, matched_tokens, key_hash, block_hashes, source_request_id, source_run_id,
--   source_episode_id, source_turn, source_span_id, source_trace_id
SELECT
    Timestamp, run_id, episode_id, turn, request_id,
    SpanId AS span_id, TraceId AS trace_id, engine, layer, reason,
    tokens AS used_tokens, prefix_tokens AS matched_tokens, key_hash, block_hashes,
    source_request_id, source_run_id, source_episode_id, source_turn, source_span_id, source_trace_id
FROM kvtrace_cache_events
WHERE event = '${EVENT_CACHE_INTEGRITY_VIOLATION}'
  AND ({run:String} = '' OR run_id = {run:String})
  AND startsWith(run_id, {run_prefix:String})
  AND Timestamp >= {since:DateTime64(3)} AND Timestamp < {until:DateTime64(3)}
  AND ({engine:String} = '' OR engine = {engine:String})
ORDER BY Timestamp DESC, SpanId, event_index
LIMIT 1 BY SpanId, event_index  -- each event once, however many copies of its span were stored
