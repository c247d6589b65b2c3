-- Version 7: batch composition (docs/batching.md). Per generated token the rows and tokens of the engine step that
-- computed it, and the prompt's computed tokens per step, so a fork between two runs on one cache path can be
-- told apart by how their steps were batched. Rows stored before have none ('' and empty arrays), which the
-- fork queries read as "not recorded". The materialized view gets its new SELECT from the current DDL.
ALTER TABLE ${database}.${kvtrace_requests} ${on_cluster}
    ADD COLUMN IF NOT EXISTS batch_composition LowCardinality(String),
    ADD COLUMN IF NOT EXISTS step_rows Array(Int64) CODEC(T64),
    ADD COLUMN IF NOT EXISTS step_tokens Array(Int64) CODEC(T64),
    ADD COLUMN IF NOT EXISTS prefill_steps Array(Int64) CODEC(T64)
