-- Version 8: what `kvtrace diff` says beside each side of a fork. How llama-server chose the slot that served a
-- request (kvtrace proxy reads it from the server's log, docs/proxy.md), and where a request's per-token arrays
-- stop short of its token ids and why (a sampler row that was not the output token, rows still on the device,
-- log-probabilities the server did not report). Rows stored before have '' and 0 ("not recorded", "not cut").
-- The materialized view gets its new SELECT from the current DDL.
ALTER TABLE ${database}.${kvtrace_requests} ${on_cluster}
    ADD COLUMN IF NOT EXISTS slot_selected_by LowCardinality(String),
    ADD COLUMN IF NOT EXISTS rows_cut_at UInt32,
    ADD COLUMN IF NOT EXISTS rows_cut_reason LowCardinality(String)
