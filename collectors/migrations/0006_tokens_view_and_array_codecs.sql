-- Version 6: kvtrace_tokens becomes a view of kvtrace_requests' per-token arrays (collectors/sql/95_kvtrace_tokens.sql)
-- instead of a table filled by a materialized view from them: every row it held is the expansion of a
-- kvtrace_requests row, which keeps the arrays, so dropping the table loses nothing, and the per-token data is
-- stored once. The current DDL, run after the migrations, creates the view under the same name.
-- On a cluster the second statement drops the Distributed table and the third the local one; on one node the
-- third finds nothing left.
-- The per-token arrays of kvtrace_requests get codecs that read several times faster than the default LZ4
-- (benchmarks/query_latency.py): T64 for token ids (small ids pack into few bits; keyed hashes stay as they are)
-- and none for margins and log-probabilities, which no general codec shrinks. Parts written before keep LZ4
-- until they are merged. token_digest, the digest of token_ids the fork queries compare instead of the arrays,
-- is computed on insert; for rows stored before, ClickHouse computes it when it is read.
DROP VIEW IF EXISTS ${database}.`kvtrace_tokens_mv` ${on_cluster};
DROP TABLE IF EXISTS ${database}.`kvtrace_tokens` ${on_cluster} SYNC;
DROP TABLE IF EXISTS ${database}.${kvtrace_tokens} ${on_cluster} SYNC;
ALTER TABLE ${database}.${kvtrace_requests} ${on_cluster}
    MODIFY COLUMN token_ids Array(Int64) CODEC(T64),
    MODIFY COLUMN top1_ids Array(Int64) CODEC(T64),
    MODIFY COLUMN runner_up_ids Array(Int64) CODEC(T64),
    MODIFY COLUMN margins Array(Float64) CODEC(NONE),
    MODIFY COLUMN logprobs Array(Float64) CODEC(NONE),
    ADD COLUMN IF NOT EXISTS token_digest UInt64 MATERIALIZED cityHash64(token_ids) AFTER logprobs
