-- Version 8: how llama-server chose the slot that served a request (kvtrace proxy reads it from the server's log,
-- docs/proxy.md), so that `kvtrace diff` shows it beside each side's cache path. Rows stored before have ''
-- ("not recorded"). The materialized view gets its new SELECT from the current DDL.
ALTER TABLE ${database}.${kvtrace_requests} ${on_cluster}
    ADD COLUMN IF NOT EXISTS slot_selected_by LowCardinality(String)
