-- answers: Everything needed to re-execute one run's requests: each request once, in the order the
--   engine served them, with its prompt and generated token ids (ids capture only), how its prompt
--   was served (layer, reused tokens, the span that stored a restored state) and the engine
--   configuration it recorded (vLLM's cache settings too), and the engine steps that computed it
--   (batch_composition, per generated token step_rows and step_tokens, prefill_steps). Prompt ids
--   and a served request's slot are read from the request span itself (otel_traces): only replay
--   needs them, so the typed requests table does not carry them for every other query.
-- params: run String
-- columns: span_id, run_id, episode_id, turn, capture_mode, engine, engine_version, model,
--   model_fingerprint, numerics_settings, cache_settings, sampling_settings, cache_layer, reused_tokens,
--   source_span_id, slot_id, prompt_tokens, prompt_token_ids, token_ids, batch_composition, step_rows,
--   step_tokens, prefill_steps, duration_ns
WITH
${shared_requests_once}
(run) -> run = {run:String} AS in_runs,
run_requests AS (
    SELECT TraceId, SpanId, Timestamp, run_id, episode_id, turn, capture_mode, engine, engine_version, model,
           model_fingerprint, numerics_settings, cache_settings, sampling_settings, cache_layer, reused_tokens, source_span_id,
           prompt_tokens, token_ids, batch_composition, step_rows, step_tokens, prefill_steps, duration_ns
    FROM requests_once
    WHERE run_id = {run:String}
),
prompts AS (
    SELECT TraceId, SpanId,
           JSONExtract(SpanAttributes['${PROMPT_TOKEN_IDS}'], 'Array(Int64)') AS prompt_token_ids,
           toInt64OrNull(SpanAttributes['${SERVER_SLOT_ID}']) AS slot_id
    FROM otel_traces
    WHERE SpanName = '${SPAN_REQUEST}' AND SpanAttributes['${RUN_ID}'] = {run:String}
    LIMIT 1 BY TraceId, SpanId
)
SELECT
    r.SpanId AS span_id, r.run_id AS run_id, r.episode_id AS episode_id, toInt64(r.turn) AS turn,
    r.capture_mode AS capture_mode, r.engine AS engine, r.engine_version AS engine_version, r.model AS model,
    r.model_fingerprint AS model_fingerprint, r.numerics_settings AS numerics_settings,
    r.cache_settings AS cache_settings,
    r.sampling_settings AS sampling_settings, r.cache_layer AS cache_layer, r.reused_tokens AS reused_tokens,
    r.source_span_id AS source_span_id, p.slot_id AS slot_id, r.prompt_tokens AS prompt_tokens, p.prompt_token_ids AS prompt_token_ids,
    r.token_ids AS token_ids, r.batch_composition AS batch_composition, r.step_rows AS step_rows,
    r.step_tokens AS step_tokens, r.prefill_steps AS prefill_steps, r.duration_ns AS duration_ns
FROM run_requests AS r
LEFT JOIN prompts AS p ON p.TraceId = r.TraceId AND p.SpanId = r.SpanId
ORDER BY r.Timestamp, r.SpanId
