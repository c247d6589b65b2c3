-- Version 6: kvtrace_tokens becomes a view of kvtrace_requests' per-token arrays (collectors/sql/95_kvtrace_tokens.sql)
-- instead of a table filled by a materialized view from them: every row it held is the expansion of a
-- kvtrace_requests row, which keeps the arrays, so dropping the table loses nothing, and the per-token data is
-- stored once. The current DDL, run after the migrations, creates the view under the same name.
-- On a cluster the second statement drops the Distributed table and the third the local one; on one node the
-- third finds nothing left.
DROP VIEW IF EXISTS ${database}.`kvtrace_tokens_mv` ${on_cluster};
DROP TABLE IF EXISTS ${database}.`kvtrace_tokens` ${on_cluster} SYNC;
DROP TABLE IF EXISTS ${database}.${kvtrace_tokens} ${on_cluster} SYNC
