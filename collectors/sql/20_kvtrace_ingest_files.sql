-- kvtrace_ingest_files: how far each spool / OTLP-JSON file has been ingested (makes ingest idempotent
-- and resumable). file_key identifies a file by its first line, so a renamed or copied file is known.
CREATE TABLE IF NOT EXISTS ${database}.${kvtrace_ingest_files} ${on_cluster} (
    file_key String,
    path String,
    offset UInt64,
    lines UInt64,
    spans UInt64,
    quarantined UInt64,
    complete UInt8,
    updated DateTime64(6)
) ENGINE = ${replacing_engine}
ORDER BY file_key
