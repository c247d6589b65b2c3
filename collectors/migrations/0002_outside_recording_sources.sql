-- Version 2: where a request's numbers came from when it was recorded outside an engine (a probe, an
-- imported log): the prompt hash (token ids or request text), the reused-token count (the server's
-- usage or timings, assumed, unknown) and the token ids (the engine's or hashes of token text).
-- Runs compare fairly only when these agree.  Requests recorded inside an engine leave them empty, as
-- do the rows stored before this version.
ALTER TABLE ${database}.${kvtrace_requests} ${on_cluster}
    ADD COLUMN IF NOT EXISTS prompt_hash_source LowCardinality(String) AFTER prompt_hash,
    ADD COLUMN IF NOT EXISTS reused_tokens_source LowCardinality(String) AFTER replayed_tokens,
    ADD COLUMN IF NOT EXISTS token_id_source LowCardinality(String) AFTER output_hash
