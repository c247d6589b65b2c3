-- answers: Why runs A and B forked: per forked episode, each side's cache path at the forking turn,
--   an attribution label, the culprit cache event with its provenance, and the margins at the fork.
--   Forks are found exactly as in forks.sql (first turn whose prompt or output differs; first
--   differing token position; -1 for a prompt mismatch). Labels, most specific first:
--     prompt_mismatch   the prompts already differ at this turn: the fork happened upstream (in what
--                       was sent, e.g. an earlier turn's output fed back), not in this request;
--     output_cancelled  one side's output ends at the fork because its request was cancelled (its client
--                       went away) while the other's went on: no token was decided there;
--     foreign_state     a forking request continued from a state that failed its integrity check (a
--                       kvtrace.cache.integrity_violation event: not its own prompt's prefix), whatever
--                       the other side did;
--     hit_vs_recompute  one side reused cached state (reused_tokens > 0), the other recomputed;
--     reuse_length      both reused, different numbers of tokens;
--     cache_source      same length, different source state (layer, state key, hit blocks, or the
--                       episode/turn of the request that stored the state differ);
--     batch_composition identical cache paths, but the engine batched them differently (both sides
--                       recorded it, docs/batching.md): the prompt was split into other steps, or a
--                       step of a token up to the fork held other rows or tokens;
--     same_cache_path   identical cache paths and no recorded batching difference: the fork is not
--                       explained by caching.
--   The culprit is the side that continued from foreign state (foreign_state; side A when both did),
--   reused (hit_vs_recompute), reused more (reuse_length), or restored state stored by another
--   episode (cache_source; side A when both or neither did); its event is the span's integrity
--   violation, else restore, else reuse, else lookup hit (request-level cache fields when it has no
--   events).
--   near_tie: 1 when the smaller of the two margins at the fork is below near_tie raw logits. The
--   default 0.05 sits above the margins of the cache-path forks measured on quantized llama.cpp
--   models (0.003-0.03 raw logits) and well below typical margins (median ~0.6), so it flags the
--   choices a cache path can plausibly flip; raise it for coarser quantization. margin_share
--   puts the fork margin in context: the share of all tokens of both runs whose margin is at most
--   the fork margin, rounded up to the next of 0.1 %, 0.5 %, 1 %, 2 %, 5 %, 10 %, 25 %, 50 %, 100 %.
--   The levels come from a histogram at 8 significant bits (bfloat16), and the fork margin is
--   compared with them at that precision: a fork margin within about 0.8 % of a level (or, among
--   few margins, next to it) can be put one step away from where exact quantiles would put it.
--   turn_a / turn_b compare one turn of each run per episode instead (see shared/diff_sides.sql).
--   step_rows_* / step_tokens_*: the rows and tokens of the engine step that computed the token at the fork
--   (-1 when not recorded); prefill_steps_*: how the prompt's computed tokens were split into steps.
--   slot_selected_by_*: how llama-server chose the slot that served the side ('' when not recorded).
--   rows_cut_at_* / rows_cut_reason_*: the position from which the side's per-token arrays were left out
--   (its token ids kept) and why (-1 and '' when they were not): a fork there has no margin.
--   finish_reason_*: why the side's output ended (a side whose output ended before the fork has token -1).
-- params: run_a String, run_b String, episode String = '', near_tie Float64 = 0.05, turn_a Int64 = -1,
--   turn_b Int64 = -1
-- columns: episode_id, fork_turn, fork_kind, position, attribution, note, run_a, run_b,
--   span_id_a, span_id_b, request_id_a, request_id_b, capture_mode,
--   token_a, token_b, runner_up_a, runner_up_b, margin_a, margin_b, near_tie, margin_share,
--   layer_a, reused_tokens_a, prompt_tokens_a, state_key_a, source_episode_id_a, source_turn_a,
--   layer_b, reused_tokens_b, prompt_tokens_b, state_key_b, source_episode_id_b, source_turn_b,
--   culprit_side, culprit_run, culprit_span_id, culprit_event, culprit_event_index, culprit_layer,
--   culprit_reused_tokens, culprit_key_hash, culprit_block_hashes,
--   culprit_source_request_id, culprit_source_run_id, culprit_source_episode_id, culprit_source_turn,
--   culprit_source_span_id, batch_composition_a, batch_composition_b, step_rows_a, step_rows_b,
--   step_tokens_a, step_tokens_b, prefill_steps_a, prefill_steps_b, slot_selected_by_a, slot_selected_by_b,
--   rows_cut_at_a, rows_cut_at_b, rows_cut_reason_a, rows_cut_reason_b, finish_reason_a, finish_reason_b
WITH
${shared_requests_once}
(run) -> run IN ({run_a:String}, {run_b:String}) AS in_runs,
${shared_output_divergence}
${shared_diff_sides}
${shared_first_fork}
-- Spans of either run whose engine continued from a state that is not their prompt's prefix.
violated_spans AS (
    SELECT SpanId
    FROM kvtrace_cache_events
    WHERE run_id IN ({run_a:String}, {run_b:String}) AND event = '${EVENT_CACHE_INTEGRITY_VIOLATION}'
),
-- attribution is computed a subquery below its uses: an alias mentioned again in the same SELECT is
-- planned again at every mention.
attributed AS (
    SELECT
        *,
        multiIf(
            attribution = '${ATTRIBUTION_FOREIGN_STATE}', if(foreign_state_a, 'a', 'b'),
            attribution = '${ATTRIBUTION_HIT_VS_RECOMPUTE}', if(reused_tokens_a > 0, 'a', 'b'),
            attribution = '${ATTRIBUTION_REUSE_LENGTH}', if(reused_tokens_a > reused_tokens_b, 'a', 'b'),
            attribution = '${ATTRIBUTION_CACHE_SOURCE}', if(foreign_source_b AND NOT foreign_source_a, 'b', 'a'),
            '') AS culprit_side,
        multiIf(culprit_side = 'a', span_id_a, culprit_side = 'b', span_id_b, '') AS culprit_span_id
    FROM (
        SELECT
            *,
            multiIf(
                prompt_differs, '${ATTRIBUTION_PROMPT_MISMATCH}',
                (token_a = -1 AND finish_reason_a = '${FINISH_CANCELLED}')
                    OR (token_b = -1 AND finish_reason_b = '${FINISH_CANCELLED}'), '${ATTRIBUTION_OUTPUT_CANCELLED}',
                foreign_state_a OR foreign_state_b, '${ATTRIBUTION_FOREIGN_STATE}',
                (reused_tokens_a > 0) != (reused_tokens_b > 0), '${ATTRIBUTION_HIT_VS_RECOMPUTE}',
                reused_tokens_a > 0 AND reused_tokens_a != reused_tokens_b, '${ATTRIBUTION_REUSE_LENGTH}',
                reused_tokens_a > 0 AND (layer_a != layer_b OR state_key_a != state_key_b
                    OR hit_block_hashes_a != hit_block_hashes_b
                    OR source_episode_id_a != source_episode_id_b OR source_turn_a != source_turn_b),
                    '${ATTRIBUTION_CACHE_SOURCE}',
                batch_composition_a = '${BATCH_RECORDED}' AND batch_composition_b = '${BATCH_RECORDED}'
                    AND (prefill_steps_a != prefill_steps_b OR steps_differ), '${ATTRIBUTION_BATCH_COMPOSITION}',
                '${ATTRIBUTION_SAME_CACHE_PATH}') AS attribution,
            (source_episode_id_a != '' AND source_episode_id_a != episode_id) AS foreign_source_a,
            (source_episode_id_b != '' AND source_episode_id_b != episode_id) AS foreign_source_b,
            span_id_a IN violated_spans AS foreign_state_a,
            span_id_b IN violated_spans AS foreign_state_b
        FROM episode_forks
        WHERE found = 1
    )
),
-- The event that served the culprit's prefix: an integrity violation (naming the foreign state's
-- origin) beats a restore beats a reuse beats a lookup hit. Both runs' serving events stream past the
-- forks (the hash join's small side) and each fork keeps its culprit span's best one (event columns
-- prefixed e_; a fork whose culprit has no event keeps its row, e_SpanId empty).
culprits AS (
    SELECT f.*, e.SpanId AS e_SpanId, e.event AS e_event, e.event_index AS e_event_index, e.layer AS e_layer,
           e.key_hash AS e_key_hash, e.block_hashes AS e_block_hashes, e.source_span_id AS e_source_span_id,
           e.source_request_id AS e_source_request_id, e.source_run_id AS e_source_run_id,
           e.source_episode_id AS e_source_episode_id, e.source_turn AS e_source_turn, e.serving_rank AS e_rank
    FROM (SELECT SpanId, event, event_index, layer, key_hash, block_hashes, source_span_id, source_request_id,
                 source_run_id, source_episode_id, source_turn,
                 multiIf(event = '${EVENT_CACHE_INTEGRITY_VIOLATION}', 0, event = '${EVENT_CACHE_RESTORE}', 1,
                         event = '${EVENT_CACHE_REUSE}', 2, 3) AS serving_rank
          FROM kvtrace_cache_events FINAL
          WHERE run_id IN ({run_a:String}, {run_b:String})
            AND ({episode:String} = '' OR episode_id = {episode:String})
            AND (event IN ('${EVENT_CACHE_INTEGRITY_VIOLATION}', '${EVENT_CACHE_RESTORE}', '${EVENT_CACHE_REUSE}')
                 OR (event = '${EVENT_CACHE_LOOKUP}' AND outcome = '${OUTCOME_HIT}'))) AS e
    RIGHT JOIN attributed AS f ON e.SpanId = f.culprit_span_id
    ORDER BY episode_id, e_rank, e_event_index
    LIMIT 1 BY episode_id
),
-- The finite margins of kvtrace_tokens, read as kvtrace_requests' per-request arrays (the tokens
-- table is their expansion, every record included, so not requests_once): the same values, without
-- a row per token to read and filter. The
-- levels only place the fork margin among coarse steps, so a bfloat16 histogram (deterministic,
-- one pass) stands in for exact quantiles, which select over every margin of both runs and cost
-- several times more. It truncates each margin to 8 significant bits (what bfloat16_truncated
-- does) and takes rank ceil(n * level) where exact quantiles take floor(n * level) + 1 (the same
-- rank unless n * level is whole); the fork margin is truncated alike before the comparison, so
-- a fork margin equal to a level still counts as within it.
margin_levels AS (
    SELECT quantilesBFloat16Array(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)(arrayFilter(m -> isFinite(m), margins))
        AS levels
    FROM kvtrace_requests FINAL
    WHERE run_id IN ({run_a:String}, {run_b:String})
),
x -> reinterpretAsFloat32(bitAnd(reinterpretAsUInt32(toFloat32(x)), 0xFFFF0000)) AS bfloat16_truncated
SELECT
    f.episode_id AS episode_id,
    toInt64(f.turn) AS fork_turn,
    if(f.prompt_differs, '${FORK_KIND_PROMPT}', '${FORK_KIND_OUTPUT}') AS fork_kind,
    f.position AS position,
    f.attribution AS attribution,
    multiIf(
        f.attribution = '${ATTRIBUTION_PROMPT_MISMATCH}',
        concat('prompts differ at turn ', toString(f.turn),
               ': the fork happened upstream of this request (earlier output or harness input)'),
        f.attribution = '${ATTRIBUTION_SAME_CACHE_PATH}',
        'both sides took the same cache path: not explained by caching',
        f.attribution = '${ATTRIBUTION_OUTPUT_CANCELLED}',
        concat('side ', if(f.token_a = -1, 'A', 'B'), '''s request was cancelled after ', toString(f.position),
               ' tokens while the other side''s went on: no token was decided there, whatever the cache paths'),
        f.attribution = '${ATTRIBUTION_BATCH_COMPOSITION}',
        concat('both sides took the same cache path, batched differently: ',
               if(f.prefill_steps_a != f.prefill_steps_b,
                  concat('the prompt was computed in ', toString(length(f.prefill_steps_a)), ' vs ',
                         toString(length(f.prefill_steps_b)), ' steps; '), ''),
               'the fork token''s step held ', toString(f.step_rows_a), ' vs ', toString(f.step_rows_b), ' rows (',
               toString(f.step_tokens_a), ' vs ', toString(f.step_tokens_b), ' tokens)'),
        concat('side ', upper(f.culprit_side), ' ',
               if(f.culprit_side = 'a', f.layer_a, f.layer_b), ' served ',
               toString(if(f.culprit_side = 'a', f.reused_tokens_a, f.reused_tokens_b)), ' of ',
               toString(if(f.culprit_side = 'a', f.prompt_tokens_a, f.prompt_tokens_b)), ' prompt tokens',
               if(f.attribution = '${ATTRIBUTION_FOREIGN_STATE}', ' from a state that is not its prompt''s prefix', ''))
    ) AS note,
    {run_a:String} AS run_a,
    {run_b:String} AS run_b,
    f.span_id_a AS span_id_a, f.span_id_b AS span_id_b,
    f.request_id_a AS request_id_a, f.request_id_b AS request_id_b,
    f.capture_mode AS capture_mode,
    f.token_a AS token_a, f.token_b AS token_b,
    f.runner_up_a AS runner_up_a, f.runner_up_b AS runner_up_b,
    f.margin_a AS margin_a, f.margin_b AS margin_b,
    toUInt8(isFinite(least(f.margin_a, f.margin_b)) AND least(f.margin_a, f.margin_b) < {near_tie:Float64})
        AS near_tie,
    if(isFinite(least(f.margin_a, f.margin_b)) AND notEmpty(m.levels),
       arrayElement([0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0],
                    arrayCount(q -> q < bfloat16_truncated(least(f.margin_a, f.margin_b)), m.levels) + 1),
       nan) AS margin_share,
    f.layer_a AS layer_a, f.reused_tokens_a AS reused_tokens_a, f.prompt_tokens_a AS prompt_tokens_a,
    f.state_key_a AS state_key_a, f.source_episode_id_a AS source_episode_id_a, f.source_turn_a AS source_turn_a,
    f.layer_b AS layer_b, f.reused_tokens_b AS reused_tokens_b, f.prompt_tokens_b AS prompt_tokens_b,
    f.state_key_b AS state_key_b, f.source_episode_id_b AS source_episode_id_b, f.source_turn_b AS source_turn_b,
    f.culprit_side AS culprit_side,
    multiIf(f.culprit_side = 'a', {run_a:String}, f.culprit_side = 'b', {run_b:String}, '') AS culprit_run,
    f.culprit_span_id AS culprit_span_id,
    f.e_event AS culprit_event,
    if(f.e_SpanId != '', toInt64(f.e_event_index), toInt64(-1)) AS culprit_event_index,
    if(f.e_layer != '', f.e_layer, if(f.culprit_side = 'a', f.layer_a, if(f.culprit_side = 'b', f.layer_b, '')))
        AS culprit_layer,
    multiIf(f.culprit_side = 'a', f.reused_tokens_a, f.culprit_side = 'b', f.reused_tokens_b, 0)
        AS culprit_reused_tokens,
    if(f.e_key_hash != '', f.e_key_hash, multiIf(f.culprit_side = 'a', f.state_key_a, f.culprit_side = 'b', f.state_key_b, ''))
        AS culprit_key_hash,
    if(notEmpty(f.e_block_hashes), f.e_block_hashes,
       multiIf(f.culprit_side = 'a', f.hit_block_hashes_a, f.culprit_side = 'b', f.hit_block_hashes_b, []))
        AS culprit_block_hashes,
    if(f.e_source_span_id != '', f.e_source_request_id,
       multiIf(f.culprit_side = 'a', f.source_request_id_a, f.culprit_side = 'b', f.source_request_id_b, ''))
        AS culprit_source_request_id,
    if(f.e_source_span_id != '', f.e_source_run_id,
       multiIf(f.culprit_side = 'a', f.source_run_id_a, f.culprit_side = 'b', f.source_run_id_b, ''))
        AS culprit_source_run_id,
    if(f.e_source_span_id != '', f.e_source_episode_id,
       multiIf(f.culprit_side = 'a', f.source_episode_id_a, f.culprit_side = 'b', f.source_episode_id_b, ''))
        AS culprit_source_episode_id,
    toInt64(if(f.e_source_span_id != '', f.e_source_turn,
       multiIf(f.culprit_side = 'a', f.source_turn_a, f.culprit_side = 'b', f.source_turn_b, -1)))
        AS culprit_source_turn,
    if(f.e_source_span_id != '', f.e_source_span_id,
       multiIf(f.culprit_side = 'a', f.source_span_id_a, f.culprit_side = 'b', f.source_span_id_b, ''))
        AS culprit_source_span_id,
    f.batch_composition_a AS batch_composition_a, f.batch_composition_b AS batch_composition_b,
    f.step_rows_a AS step_rows_a, f.step_rows_b AS step_rows_b,
    f.step_tokens_a AS step_tokens_a, f.step_tokens_b AS step_tokens_b,
    f.prefill_steps_a AS prefill_steps_a, f.prefill_steps_b AS prefill_steps_b,
    f.slot_selected_by_a AS slot_selected_by_a, f.slot_selected_by_b AS slot_selected_by_b,
    toInt64(if(f.rows_cut_reason_a != '', f.rows_cut_at_a, -1)) AS rows_cut_at_a,
    toInt64(if(f.rows_cut_reason_b != '', f.rows_cut_at_b, -1)) AS rows_cut_at_b,
    f.rows_cut_reason_a AS rows_cut_reason_a, f.rows_cut_reason_b AS rows_cut_reason_b,
    f.finish_reason_a AS finish_reason_a, f.finish_reason_b AS finish_reason_b
FROM culprits AS f
CROSS JOIN margin_levels AS m
ORDER BY episode_id
SETTINGS join_use_nulls = 0
