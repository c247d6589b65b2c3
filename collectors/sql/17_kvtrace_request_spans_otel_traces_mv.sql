-- Request spans handed over by ingest → otel_traces, exactly as the Collector's exporter writes them: each
-- per-token array attribute's empty value becomes the array's JSON text, in place (the map keeps the
-- span's order). Numbers are written as Go's encoding/json writes them: ClickHouse's shortest round-trip
-- text is the same ("0.1", "-0", "1e-7", "0.000015", "5e-324"), except that Go signs a positive exponent
-- (magnitudes >= 1e21: "1e+21", where ClickHouse writes "1e21"; the pattern runs only on a text with an "e").
-- The insert carries the typed-ingest log_comment, so 11_kvtrace_requests_mv.sql passes these rows over;
-- otel_traces' other views take them as any insert.
CREATE MATERIALIZED VIEW IF NOT EXISTS ${database}.${kvtrace_request_spans_otel_traces_mv} ${on_cluster}
TO ${database}.${otel_traces}
AS SELECT * EXCEPT (packed_token_ids, packed_top1_ids, packed_runner_up_ids, packed_margins, packed_logprobs)
REPLACE (
    mapFromArrays(
        mapKeys(SpanAttributes),
        arrayConcat(
            -- The attributes before the arrays (all of them when the span has none), the arrays' texts, the rest.
            arraySlice(mapValues(SpanAttributes), 1,
                (if((arrayFirstIndex(key -> has(['${OUTPUT_TOKEN_IDS}', '${OUTPUT_TOP1_IDS}', '${OUTPUT_RUNNER_UP_IDS}',
                                                 '${OUTPUT_MARGINS}', '${OUTPUT_LOGPROBS}'], key),
                                     mapKeys(SpanAttributes)) AS first_array) = 0,
                    length(SpanAttributes) + 1, first_array) AS arrays_at) - 1),
            arrayFilter((text, present) -> present,
                [concat('[', arrayStringConcat(reinterpret(packed_token_ids, 'Array(Int64)'), ','), ']'),
                 concat('[', arrayStringConcat(reinterpret(packed_top1_ids, 'Array(Int64)'), ','), ']'),
                 concat('[', arrayStringConcat(reinterpret(packed_runner_up_ids, 'Array(Int64)'), ','), ']'),
                 if(position(concat('[', arrayStringConcat(reinterpret(packed_margins, 'Array(Float64)'), ','), ']')
                             AS margins_text, 'e') = 0,
                    margins_text, replaceRegexpAll(margins_text, 'e([0-9])', 'e+\\1')),
                 if(position(concat('[', arrayStringConcat(reinterpret(packed_logprobs, 'Array(Float64)'), ','), ']')
                             AS logprobs_text, 'e') = 0,
                    logprobs_text, replaceRegexpAll(logprobs_text, 'e([0-9])', 'e+\\1'))],
                [mapContains(SpanAttributes, '${OUTPUT_TOKEN_IDS}'),
                 mapContains(SpanAttributes, '${OUTPUT_TOP1_IDS}'),
                 mapContains(SpanAttributes, '${OUTPUT_RUNNER_UP_IDS}'),
                 mapContains(SpanAttributes, '${OUTPUT_MARGINS}'),
                 mapContains(SpanAttributes, '${OUTPUT_LOGPROBS}')]) AS array_texts,
            arraySlice(mapValues(SpanAttributes), arrays_at + length(array_texts))))
    AS SpanAttributes)
FROM ${database}.${kvtrace_request_spans}
