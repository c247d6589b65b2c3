-- Explodes kvtrace.cache.* span events of otel_traces into kvtrace_cache_events: the Collector's path (spans
-- `kvtrace db ingest` stored carry ${TYPED_ROWS_STORED}: their events are written by ingest itself).
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${kvtrace_cache_events_mv} ${on_cluster}
TO ${database}.${kvtrace_cache_events}
AS SELECT
    event_time AS Timestamp,
    TraceId,
    SpanId,
    SpanAttributes['${RUN_ID}'] AS run_id,
    SpanAttributes['${EPISODE_ID}'] AS episode_id,
    toInt32OrDefault(SpanAttributes['${TURN}'], toInt32(-1)) AS turn,
    SpanAttributes['${REQUEST_ID}'] AS request_id,
    SpanAttributes['${ENGINE_NAME}'] AS engine,
    event,
    toUInt32(event_index - 1) AS event_index,
    ea['${EVENT_LAYER}'] AS layer,
    ea['${EVENT_OUTCOME}'] AS outcome,
    ea['${EVENT_KEY_HASH}'] AS key_hash,
    toUInt32OrZero(ea['${EVENT_TOKENS}']) AS tokens,
    toUInt32OrZero(ea['${EVENT_PREFIX_TOKENS}']) AS prefix_tokens,
    toUInt32OrZero(ea['${EVENT_ENTRIES_SCANNED}']) AS entries_scanned,
    toUInt64OrZero(ea['${EVENT_SIZE_BYTES}']) AS size_bytes,
    ea['${EVENT_REASON}'] AS reason,
    JSONExtract(ea['${EVENT_BLOCK_HASHES}'], 'Array(String)') AS block_hashes,
    JSONExtract(ea['${EVENT_BLOCK_IDS}'], 'Array(Int64)') AS block_ids,
    ea['${EVENT_PARENT_HASH}'] AS parent_hash,
    ea['${EVENT_SOURCE_SPAN_ID}'] AS source_span_id,
    ea['${EVENT_SOURCE_TRACE_ID}'] AS source_trace_id,
    ea['${EVENT_SOURCE_REQUEST_ID}'] AS source_request_id,
    ea['${EVENT_SOURCE_RUN_ID}'] AS source_run_id,
    ea['${EVENT_SOURCE_EPISODE_ID}'] AS source_episode_id,
    toInt32OrDefault(ea['${EVENT_SOURCE_TURN}'], toInt32(-1)) AS source_turn,
    toUInt64OrZero(ea['${EVENT_SOURCE_TIME}']) AS source_time_unix_nano
FROM ${database}.${otel_traces}
ARRAY JOIN
    Events.Timestamp AS event_time,
    Events.Name AS event,
    Events.Attributes AS ea,
    arrayEnumerate(Events.Name) AS event_index
WHERE startsWith(event, '${CACHE_EVENT_PREFIX}') AND NOT mapContains(SpanAttributes, '${TYPED_ROWS_STORED}')
