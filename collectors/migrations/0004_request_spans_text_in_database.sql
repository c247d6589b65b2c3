-- Version 4: ingest hands kvtrace's own request spans over once, with their per-token arrays packed, to
-- the Null table kvtrace_request_spans; its two views write them into otel_traces (the arrays' JSON text
-- made by the database, as the Collector writes it) and into kvtrace_requests (the arrays as numbers).
-- This replaces version 3's kvtrace_request_arrays, to which ingest sent the spans a second time with
-- the arrays typed; the new table and views come with the current DDL. Until a database has this
-- version, ingest stores every span through the JSON view alone. The table goes before its view: an
-- ingest of version 3 still running then fails its insert and completes through the JSON view, where
-- the other order would let its rows pass through a Null table that no view reads any more.
DROP TABLE IF EXISTS ${database}.`kvtrace_request_arrays` ${on_cluster};
DROP VIEW IF EXISTS ${database}.`kvtrace_request_arrays_mv` ${on_cluster}
