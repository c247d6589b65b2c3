-- WITH-clause lambdas deciding whether and where two requests' outputs diverge; shared so that
-- forks, fork_attribution and divergence_rates (and the matched positions of margin_shift and
-- flip_rate_by_margin) use one definition.
--   first_mismatch_index(ids_a, ids_b): 1-based index of the first differing token over the common
--     length, 0 when one is a prefix of the other (or both are equal)
--   outputs_compared_by_ids(ids_a, ids_b): both sides captured token ids (else hashes are compared)
--   outputs_differ(ids_a, ids_b, hash_a, hash_b): by ids when both captured them, else by output hash
--   digests_differ(has_a, has_b, digest_a, digest_b, hash_a, hash_b): outputs_differ decided on each side's
--     notEmpty(token_ids) and token_digest (kvtrace_requests' cityHash64(token_ids)), so that finding which
--     turns differ reads and joins no array; the arrays are read again only where a position is needed
--   first_divergent_position(ids_a, ids_b, hash_a, hash_b): 0-based position of the first differing
--     token, the shorter length when one output is a prefix of the other; -1 when the outputs agree
--     or only hashes were compared
--   fork_position(prompt_a, prompt_b, ids_a, ids_b, hash_a, hash_b): first_divergent_position when the
--     prompts agree; -1 when they differ: the fork happened upstream, and outputs of different prompts
--     are not compared token by token (with hashed capture their tokens are unlinkable by design)
(ids_a, ids_b) -> arrayFirstIndex((x, y) -> x != y,
    arraySlice(ids_a, 1, least(length(ids_a), length(ids_b))),
    arraySlice(ids_b, 1, least(length(ids_a), length(ids_b)))) AS first_mismatch_index,
(ids_a, ids_b) -> notEmpty(ids_a) AND notEmpty(ids_b) AS outputs_compared_by_ids,
(ids_a, ids_b, hash_a, hash_b) -> if(outputs_compared_by_ids(ids_a, ids_b), ids_a != ids_b, hash_a != hash_b)
    AS outputs_differ,
(has_a, has_b, digest_a, digest_b, hash_a, hash_b) -> if(has_a AND has_b, digest_a != digest_b, hash_a != hash_b)
    AS digests_differ,
(ids_a, ids_b, hash_a, hash_b) -> toInt64(multiIf(
    NOT outputs_differ(ids_a, ids_b, hash_a, hash_b) OR NOT outputs_compared_by_ids(ids_a, ids_b), -1,
    first_mismatch_index(ids_a, ids_b) > 0, first_mismatch_index(ids_a, ids_b) - 1,
    least(length(ids_a), length(ids_b)))) AS first_divergent_position,
(prompt_a, prompt_b, ids_a, ids_b, hash_a, hash_b) -> if(prompt_a != prompt_b, toInt64(-1),
    first_divergent_position(ids_a, ids_b, hash_a, hash_b)) AS fork_position,
