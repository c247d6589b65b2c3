-- kvtrace_ingest_lines: the hash of every span-file line `kvtrace db ingest` stored, written after its rows, so
-- a line met again in another file (a copy, a concatenation in another order) is counted, not stored again.
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_ingest_lines} ${on_cluster} (
    line_hash String,
    spans UInt32
) ENGINE = ${span_engine}
ORDER BY line_hash
