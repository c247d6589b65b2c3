-- WITH-clause lambdas deciding whether and where two requests' outputs diverge; shared so that
-- forks, fork_attribution and divergence_rates (and the matched positions of margin_shift and
-- flip_rate_by_margin) use one definition.
--   first_mismatch_index(ids_a, ids_b): 1-based index of the first differing token over the common
--     length, 0 when one is a prefix of the other (or both are equal)
--   digests_differ(has_a, has_b, digest_a, digest_b, hash_a, hash_b): whether the outputs differ: by
--     token ids when both sides captured them (has_*: notEmpty(token_ids)), compared through
--     kvtrace_requests' token_digest (cityHash64(token_ids)) so that finding which turns differ reads
--     and joins no array; else by output hash
--   fork_position(prompt_a, prompt_b, ids_a, ids_b): 0-based position of the first differing token,
--     the shorter length when one output is a prefix of the other; -1 when the outputs agree, when
--     only hashes can be compared (a side without ids) and when the prompts differ: the fork happened
--     upstream, and outputs of different prompts are not compared token by token (with hashed capture
--     their tokens are unlinkable by design). The arrays are padded to one length with -2 and -3,
--     which no token id or keyed hash is, so a prefix differs where the shorter one ends.
-- Lambdas are expanded wherever they are called, and nested ones again inside each: the analyzer's
-- time on a query grows with the expansion, so these call no other lambda.
(ids_a, ids_b) -> arrayFirstIndex((x, y) -> x != y,
    arraySlice(ids_a, 1, least(length(ids_a), length(ids_b))),
    arraySlice(ids_b, 1, least(length(ids_a), length(ids_b)))) AS first_mismatch_index,
(has_a, has_b, digest_a, digest_b, hash_a, hash_b) -> if(has_a AND has_b, digest_a != digest_b, hash_a != hash_b)
    AS digests_differ,
(prompt_a, prompt_b, ids_a, ids_b) -> if(prompt_a != prompt_b OR empty(ids_a) OR empty(ids_b), toInt64(-1),
    toInt64(arrayFirstIndex((x, y) -> x != y,
        arrayResize(ids_a, greatest(length(ids_a), length(ids_b)), toInt64(-2)),
        arrayResize(ids_b, greatest(length(ids_a), length(ids_b)), toInt64(-3)))) - 1) AS fork_position,
