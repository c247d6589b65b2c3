"""Every span name, attribute key and event name kvtrace emits.

This is the contract between the engine patches (which fill records), the
recorder (which turns records into spans), the ClickHouse views (which read the
attributes back out of ``otel_traces``) and the saved queries.  OpenTelemetry
GenAI names are used where they exist; everything else lives under
``kvtrace.``.  Nothing else in the code base spells these strings.
"""

from __future__ import annotations

# --- span and scope names ---------------------------------------------------

INSTRUMENTATION_SCOPE = "kvtrace"
SPAN_REQUEST = "kvtrace.request"
"""One span per generation call (one prompt in, one completion out)."""
TYPED_ROWS_STORED = "kvtrace.storage.typed_rows"
"""``true`` on the ``otel_traces`` row of a span ``kvtrace db ingest`` stored: its typed rows (request, cache events)
and its per-token arrays are in kvtrace's tables, written there by ingest, so the views on ``otel_traces`` pass it over."""

# --- correlation (also the W3C baggage keys) --------------------------------

RUN_ID = "kvtrace.run_id"
EPISODE_ID = "kvtrace.episode_id"
TURN = "kvtrace.turn"
TURN_MIN, TURN_MAX = -(2**31), 2**31 - 1
"""A turn's range: Int32 in the typed tables."""
REQUEST_ID = "kvtrace.request_id"

# --- configuration ------------------------------------------------------------

GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

ENGINE_NAME = "kvtrace.engine.name"
ENGINE_VERSION = "kvtrace.engine.version"
MODEL_FINGERPRINT = "kvtrace.model.fingerprint"
MODEL_WEIGHT_FORMAT = "kvtrace.model.weight_format"
KV_CACHE_TYPE = "kvtrace.kv_cache.type"
CACHE_SETTINGS = "kvtrace.cache.settings"
"""JSON object string with the cache settings in force (prompt cache kind, capacity, prefix caching on/off...)."""
NUMERICS_SETTINGS = "kvtrace.numerics.settings"
"""JSON object string: threads, n_batch, n_ubatch, flash attention, dtype... anything that changes numerics."""
SAMPLING_SETTINGS = "kvtrace.sampling.settings"
"""JSON object string: every sampling parameter of the request (penalties included)."""
ARM = "kvtrace.arm"
"""Free-form label of the experiment arm / cache configuration (e.g. ``reuse``, ``off``)."""
ARM_SHADOW = "shadow"
"""The arm of a proxy's shadow twin: the cold recompute of a live cache-hit request (``kvtrace proxy --shadow``)."""
CAPTURE_MODE = "kvtrace.capture.mode"
"""What of the token content left the engine (values below; see ``kvtrace.recording.capture``)."""
CAPTURE_IDS = "ids"
"""Plain token ids."""
CAPTURE_HASHED = "hashed"
"""Every token id replaced by a keyed hash: equality across runs survives, content does not."""
CAPTURE_NONE = "none"
"""No per-token ids (margins and aggregate hashes stay)."""
CAPTURE_MODES = (CAPTURE_IDS, CAPTURE_HASHED, CAPTURE_NONE)

# --- prompt -------------------------------------------------------------------

PROMPT_HASH = "kvtrace.prompt.hash"
PROMPT_BLOCK_SIZE = "kvtrace.prompt.block_size"
PROMPT_BLOCK_HASHES = "kvtrace.prompt.block_hashes"
"""Chained hashes over fixed-size prompt blocks, first block first."""
PROMPT_BLOCK_LAYERS = "kvtrace.prompt.block_layers"
"""Per prompt block, the cache layer that served it (``none`` when recomputed)."""
PROMPT_TOKEN_IDS = "kvtrace.prompt.token_ids"

# --- cache provenance (request level) -----------------------------------------

CACHE_LAYER = "kvtrace.cache.layer"
CACHE_REUSED_TOKENS = "kvtrace.cache.reused_tokens"
CACHE_RECOMPUTED_TOKENS = "kvtrace.cache.recomputed_tokens"
CACHE_REPLAYED_TOKENS = "kvtrace.cache.replayed_tokens"
"""Tokens re-evaluated although cached (llama.cpp replays one token when the whole prompt matched)."""
CACHE_STATE_KEY = "kvtrace.cache.state_key"
"""Identity (hash) of the reused state: prompt-cache key hash, or the last hit block hash."""
CACHE_SOURCE_SPAN_ID = "kvtrace.cache.source.span_id"
CACHE_SOURCE_TRACE_ID = "kvtrace.cache.source.trace_id"
CACHE_SOURCE_REQUEST_ID = "kvtrace.cache.source.request_id"
CACHE_SOURCE_RUN_ID = "kvtrace.cache.source.run_id"
CACHE_SOURCE_EPISODE_ID = "kvtrace.cache.source.episode_id"
CACHE_SOURCE_TURN = "kvtrace.cache.source.turn"
CACHE_SOURCE_TIME = "kvtrace.cache.source.time_unix_nano"
CACHE_HIT_BLOCK_HASHES = "kvtrace.cache.hit_block_hashes"

# Cache layers (values of CACHE_LAYER and of the per-event layer attribute).
LAYER_NONE = "none"
LAYER_KV_REUSE = "kv_reuse"
LAYER_PROMPT_CACHE = "prompt_cache"
LAYER_PREFIX_BLOCKS = "prefix_blocks"
CACHE_LAYERS = (LAYER_NONE, LAYER_KV_REUSE, LAYER_PROMPT_CACHE, LAYER_PREFIX_BLOCKS)

# --- cache events (span events) -----------------------------------------------

CACHE_EVENT_PREFIX = "kvtrace.cache."
EVENT_CACHE_LOOKUP = "kvtrace.cache.lookup"
EVENT_CACHE_REUSE = "kvtrace.cache.reuse"
EVENT_CACHE_RESTORE = "kvtrace.cache.restore"
EVENT_CACHE_STORE = "kvtrace.cache.store"
EVENT_CACHE_EVICT = "kvtrace.cache.evict"
EVENT_CACHE_RESET = "kvtrace.cache.reset"
EVENT_CACHE_INTEGRITY_VIOLATION = "kvtrace.cache.integrity_violation"
"""The state an engine reused or restored is not the request's own prompt prefix: the event names both
sides (this span; the state's origin in the ``EVENT_SOURCE_*`` attributes), ``EVENT_LAYER`` the cache,
``EVENT_REASON`` how it was found (``INTEGRITY_*``), ``EVENT_PREFIX_TOKENS`` the tokens that did match."""
CACHE_EVENTS = (
    EVENT_CACHE_LOOKUP,
    EVENT_CACHE_REUSE,
    EVENT_CACHE_RESTORE,
    EVENT_CACHE_STORE,
    EVENT_CACHE_EVICT,
    EVENT_CACHE_RESET,
    EVENT_CACHE_INTEGRITY_VIOLATION,
)

# Attributes carried by cache events.
EVENT_LAYER = "kvtrace.cache.layer"
EVENT_OUTCOME = "kvtrace.cache.outcome"
"""lookup: ``hit`` / ``miss`` / ``skipped`` (state found but not restored)."""
EVENT_KEY_HASH = "kvtrace.cache.key_hash"
EVENT_TOKENS = "kvtrace.cache.tokens"
EVENT_PREFIX_TOKENS = "kvtrace.cache.prefix_tokens"
EVENT_ENTRIES_SCANNED = "kvtrace.cache.entries_scanned"
EVENT_SIZE_BYTES = "kvtrace.cache.size_bytes"
EVENT_REASON = "kvtrace.cache.reason"
EVENT_BLOCK_HASHES = "kvtrace.cache.block_hashes"
EVENT_BLOCK_IDS = "kvtrace.cache.block_ids"
EVENT_PARENT_HASH = "kvtrace.cache.parent_hash"
EVENT_SOURCE_SPAN_ID = CACHE_SOURCE_SPAN_ID
EVENT_SOURCE_TRACE_ID = CACHE_SOURCE_TRACE_ID
EVENT_SOURCE_REQUEST_ID = CACHE_SOURCE_REQUEST_ID
EVENT_SOURCE_RUN_ID = CACHE_SOURCE_RUN_ID
EVENT_SOURCE_EPISODE_ID = CACHE_SOURCE_EPISODE_ID
EVENT_SOURCE_TURN = CACHE_SOURCE_TURN
EVENT_SOURCE_TIME = CACHE_SOURCE_TIME

# --- output (per-token arrays on the request span) ----------------------------

OUTPUT_HASH = "kvtrace.output.hash"
OUTPUT_TOKEN_IDS = "kvtrace.output.token_ids"
"""Chosen token per position (after penalties): what the engine emitted."""
OUTPUT_TOP1_IDS = "kvtrace.output.top1_ids"
"""Raw-logit arg-max per position (before penalties); differs from the chosen id when penalties changed the choice."""
OUTPUT_RUNNER_UP_IDS = "kvtrace.output.runner_up_ids"
OUTPUT_MARGINS = "kvtrace.output.margins"
"""Raw-logit top-1 minus top-2 per position."""
OUTPUT_LOGPROBS = "kvtrace.output.logprobs"
"""Log-probability of the chosen token under the raw logits."""
OUTPUT_FINISH_REASON = "kvtrace.output.finish_reason"
OUTPUT_ROWS_CUT_AT = "kvtrace.output.rows_cut_at"
"""Output position from which the per-token arrays (top-1, runner-up, margins, log-probabilities) are
left out, the token ids kept: the sampler's row there was not the output token, or had not reached the
engine core in time (:data:`OUTPUT_ROWS_CUT_REASON`).  Absent when every token has its row."""
OUTPUT_ROWS_CUT_REASON = "kvtrace.output.rows_cut_reason"
"""Why the arrays stop at :data:`OUTPUT_ROWS_CUT_AT`: :data:`ROWS_MISALIGNED`, :data:`ROWS_LATE` or
:data:`ROWS_UNREPORTED`."""

# --- values (appended) ----------------------------------------------------------

# Values of OUTPUT_ROWS_CUT_REASON.
ROWS_MISALIGNED = "misaligned"
"""The row's chosen id is not the output token at that position (a discarded or reordered sample)."""
ROWS_LATE = "late"
"""The request's last rows had not reached the engine core when it was finished (still on the device
when its wait ran out, or never sent)."""
ROWS_UNREPORTED = "unreported"
"""The server reported every generated id but no log-probabilities for the token there (llama-server
leaves out a token that ends inside a UTF-8 character)."""

# gen_ai.operation.name values.
OPERATION_TEXT_COMPLETION = "text_completion"
OPERATION_CHAT = "chat"

# Values of EVENT_OUTCOME.
OUTCOME_HIT = "hit"
OUTCOME_MISS = "miss"
OUTCOME_SKIPPED = "skipped"
"""lookup: a state was found but not restored (the live context already covered more of the prompt)."""
OUTCOME_STORED = "stored"
OUTCOME_EVICTED_IMMEDIATELY = "evicted_immediately"
"""store: the state did not fit and was evicted by the same store."""

# Values of EVENT_REASON.
REASON_CAPACITY = "capacity"
"""evict: the cache went over its capacity (LRU)."""
REASON_TAKEN_ON_LOOKUP = "taken_on_lookup"
"""evict: the cache hands the entry out and removes it (llama-cpp-python's disk cache)."""
REASON_REPLAY_LAST_TOKEN = "replay_last_token"
"""reuse: the whole prompt was cached but its last token was re-evaluated to refresh the logits."""
REASON_PREEMPTED = "preempted"
"""lookup (vLLM): a preempted request admitted again; it recomputes what it had lost."""

CACHE_INTEGRITY = "kvtrace.cache.integrity"
"""The request's verdict on the state its engine reused or restored: ``INTEGRITY_VERIFIED`` (the state's
tokens, or its blocks' hash chain, are the prompt's own prefix), ``INTEGRITY_VIOLATED`` (they are not: a
``kvtrace.cache.integrity_violation`` event says how) or ``INTEGRITY_UNVERIFIABLE`` (nothing to compare)."""
INTEGRITY_VERIFIED = "verified"
INTEGRITY_VIOLATED = "violated"
INTEGRITY_UNVERIFIABLE = "unverifiable"
# Values of EVENT_REASON on an integrity violation: what disagreed.
INTEGRITY_TOKENS_DIFFER = "tokens_differ"
"""The stored state's tokens differ from the prompt's within the length that was reused or restored."""
INTEGRITY_HASH_CHAIN_DIFFERS = "hash_chain_differs"
"""vLLM: a hit block's hash is not the prompt's own block hash at that position."""
INTEGRITY_CACHED_COUNT_DIFFERS = "cached_count_differs"
"""llama-server: the log's restore disagrees with the cached tokens the answer reported."""
INTEGRITY_FOREIGN_PROMPT = "foreign_prompt"
"""llama-server: the restored task's prompt, as the proxy saw it, is not this prompt's prefix."""

# Values of OUTPUT_FINISH_REASON besides the engine's own (stop, length...).
FINISH_CANCELLED = "cancelled"
"""A stream closed by its consumer before the engine finished."""

# --- values of the fork queries' answers (appended) -------------------------------------------
# Rendered into queries/forks.sql and queries/fork_attribution.sql; read by kvtrace.analysis.forks and the CLI.

FORK_KIND_PROMPT = "prompt"
"""fork_kind: the prompts already differ at the forking turn (the fork happened upstream)."""
FORK_KIND_OUTPUT = "output"
"""fork_kind: same prompt, different output."""
COMPARED_BY_TOKEN_IDS = "token_ids"
"""compared_by: outputs compared token by token (both sides captured token ids)."""
COMPARED_BY_OUTPUT_HASH = "output_hash"
"""compared_by: outputs compared by their hashes only (no fork position)."""
ATTRIBUTION_PROMPT_MISMATCH = "prompt_mismatch"
ATTRIBUTION_OUTPUT_CANCELLED = "output_cancelled"
ATTRIBUTION_FOREIGN_STATE = "foreign_state"
ATTRIBUTION_HIT_VS_RECOMPUTE = "hit_vs_recompute"
ATTRIBUTION_REUSE_LENGTH = "reuse_length"
ATTRIBUTION_CACHE_SOURCE = "cache_source"
ATTRIBUTION_BATCH_COMPOSITION = "batch_composition"
ATTRIBUTION_SAME_CACHE_PATH = "same_cache_path"
"""attribution labels, most specific first (their meaning: queries/fork_attribution.sql)."""
VERDICT_CONFIRMED = "confirmed"
"""counterfactual verdict (``kvtrace replay A B --counterfactual``): switching only the cache path moves the
token at the fork to the other side's token."""
VERDICT_NOT_CACHE = "not_cache"
"""counterfactual verdict: both sides reproduce, and the fork stays with its request when the paths are switched."""
VERDICT_NOT_REPRODUCED = "not_reproduced"
"""counterfactual verdict: re-executing each side on its own recorded path does not give the recorded fork, so
something the spans do not record differs between the runs."""
VERDICTS = (VERDICT_CONFIRMED, VERDICT_NOT_CACHE, VERDICT_NOT_REPRODUCED)

# --- margin bins (appended) -------------------------------------------------------------

MARGIN_BIN_EDGES = (0.1, 0.3, 1.0)
"""Upper edges, in raw logits, of the bins top-two margins are read in: ``flip_rate_by_margin``
reports one row per bin and the fork view colours each token by its bin. The last bin is open."""
MARGIN_BIN_LABELS = tuple(f"[{low:g},{high:g})" for low, high in zip((0,) + MARGIN_BIN_EDGES, MARGIN_BIN_EDGES)) + (
    f">={MARGIN_BIN_EDGES[-1]:g}",)
"""Values of ``flip_rate_by_margin``'s ``margin_bin`` column, one per bin: ``[0,0.1)`` … ``>=1``."""

# --- records made outside an engine: probes and imported logs (appended) ----------

PROBE_ROLE = "kvtrace.probe.role"
"""``cold`` (prefix reuse bypassed or flushed) / ``warm`` (sent to be served from cache) / ``flush``."""
PROBE_BYPASS = "kvtrace.probe.bypass"
"""How the cold request bypassed prefix reuse (``cache_salt``, ``cache_prompt_false``, ``flush_request``, ``none``)."""
PROBE_ROLE_COLD = "cold"
PROBE_ROLE_WARM = "warm"

CACHE_REUSED_TOKENS_SOURCE = "kvtrace.cache.reused_tokens.source"
"""Where the reused-token count came from when it was not observed inside the engine:
``usage.prompt_tokens_details.cached_tokens``, ``timings.cache_n``, or ``assumed`` (the server reports
nothing; 0 for a cold probe request, the whole prompt for a warm one)."""
REUSED_SOURCE_OPENAI_USAGE = "usage.prompt_tokens_details.cached_tokens"
REUSED_SOURCE_LLAMA_SERVER_TIMINGS = "timings.cache_n"
REUSED_SOURCE_ASSUMED = "assumed"
REUSED_SOURCE_UNKNOWN = "unknown"

OUTPUT_TOKEN_ID_SOURCE = "kvtrace.output.token_id_source"
"""``engine``: token ids as the server reported them; ``text_hash``: 63-bit keyed hashes of each token's
bytes (OpenAI-style logprobs carry token text, not ids), comparable across runs that share the hash key."""
TOKEN_ID_SOURCE_ENGINE = "engine"
TOKEN_ID_SOURCE_TEXT_HASH = "text_hash"

PROMPT_HASH_SOURCE = "kvtrace.prompt.hash_source"
"""``token_ids`` (keyed hash of the prompt's token ids) or ``request_text`` (keyed hash of the canonical
JSON of the request's prompt / messages: the text itself is never stored)."""
PROMPT_HASH_SOURCE_TOKEN_IDS = "token_ids"
PROMPT_HASH_SOURCE_REQUEST_TEXT = "request_text"

IMPORT_SOURCE = "kvtrace.import.source"
"""File name and line number an imported request came from (``log.jsonl:17``)."""

# --- rate intervals (appended) ----------------------------------------------------------
# Rendered into queries/shared/cluster_interval.sql: the interval_method column of divergence_rates
# and flip_rate_by_margin.

INTERVAL_WILSON = "wilson"
"""Wilson score interval of k/n over the samples: every episode is one yes/no sample, or every episode
shows the same rate (e.g. no flip anywhere), so there is no spread between episodes to resample."""
INTERVAL_CLUSTER_BOOTSTRAP = "cluster bootstrap"
"""Episodes contribute several samples (orders that differ, repeats that differ, token positions):
episodes are resampled with replacement (percentile interval of 2000 resamples)."""


def names() -> dict[str, str]:
    """Every name above by its constant, for rendering ``${NAME}`` into DDL and saved queries."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, str)}

# --- records made by `kvtrace proxy` (appended) ------------------------------------------------

PROXY_UPSTREAM = "kvtrace.proxy.upstream"
"""Base URL of the server the proxy forwarded the request to."""
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
"""The upstream's HTTP status (OpenTelemetry's HTTP name); an error status also sets the span's status."""
SERVER_SLOT_ID = "kvtrace.server.slot_id"
"""The llama-server slot that served the request, where known (its native answer, or a server with one slot)."""
SERVER_SLOT_SELECTED_BY = "kvtrace.server.slot_selected_by"
"""How llama-server chose the request's slot, from its log: ``lcp_similarity`` (the slot whose state shared
the most of the prompt, above the server's threshold), ``lru`` (the one idle longest: no slot's state was
similar enough) or ``id`` (the request named the slot)."""
SLOT_SELECTED_BY_LCP_SIMILARITY = "lcp_similarity"
SLOT_SELECTED_BY_LRU = "lru"
SLOT_SELECTED_BY_ID = "id"
SERVER_SLOT_SIMILARITY = "kvtrace.server.slot_similarity"
"""With ``lcp_similarity``: the share of the prompt the chosen slot's state had in common with it
(llama-server's ``f_sim_best``, 0 to 1)."""

MARGIN_SOURCE = "kvtrace.output.margin_source"
"""Where the margins came from: ``injected`` (the proxy asked the upstream for the top two and took them
out of the client's answer), ``client`` (the client asked for logprobs itself), ``unavailable`` (neither:
tokens and margins are not recorded)."""
MARGIN_SOURCE_INJECTED = "injected"
MARGIN_SOURCE_CLIENT = "client"
MARGIN_SOURCE_UNAVAILABLE = "unavailable"

MARGIN_UNIT = "kvtrace.output.margin_unit"
"""``raw_logit`` (top-1 − top-2 of the raw logits; equal to the log-softmax difference) or
``post_sampling_logprob`` (the difference of log probabilities a server computed after its sampling chain)."""
MARGIN_UNIT_RAW_LOGIT = "raw_logit"
MARGIN_UNIT_POST_SAMPLING_LOGPROB = "post_sampling_logprob"
SERVER_TASK_ID = "kvtrace.server.task_id"
"""llama-server's task id for the request, from its log (``kvtrace proxy --llama-server-log``)."""
SERVER_TASK_MATCH = "kvtrace.server.task_match"
"""How the request was tied to a task of the server's log (docs/proxy.md): ``marker`` (the log printed
the marker the proxy set on the request), ``timings`` (the answer's prompt, computed and generated counts
fit one task alone, which no other waiting request could own), ``log`` (the same without timings in the
answer), ``ambiguous`` (the server's output cannot tell it from another request; no cache decision is
attributed) or ``none`` (no task fits)."""
TASK_MATCH_MARKER = "marker"
TASK_MATCH_TIMINGS = "timings"
TASK_MATCH_LOG = "log"
TASK_MATCH_AMBIGUOUS = "ambiguous"
TASK_MATCH_NONE = "none"
REASON_SOURCE_UNKNOWN = "source_unknown"
"""restore (prompt cache seen from a server's log): the restored state's origin cannot be named
unambiguously (two candidates alike, or stored by a request the proxy did not trace)."""

# --- batch composition (appended; docs/batching.md) ------------------------------------------

OUTPUT_STEP_ROWS = "kvtrace.output.step_rows"
"""Per generated token: how many sequences (rows) the engine step that computed its logits held."""
OUTPUT_STEP_TOKENS = "kvtrace.output.step_tokens"
"""Per generated token: how many tokens that engine step computed, over all its rows."""
PROMPT_PREFILL_STEPS = "kvtrace.prompt.prefill_steps"
"""The prompt's computed (not reused) tokens per engine step, in order: how chunked prefill or
micro-batches split it."""
BATCH_COMPOSITION = "kvtrace.batch.composition"
"""``recorded`` (the step arrays above were filled by the engine's hooks) or ``unknown`` (the engine's
steps are out of kvtrace's sight, e.g. llama-server behind the proxy); absent on older spans."""
BATCH_RECORDED = "recorded"
BATCH_UNKNOWN = "unknown"
BATCH_ROWS_BIN_EDGES = (1, 2, 4, 8)
"""Upper edges of the bins ``flip_rate_by_batch_rows`` reads the difference in step rows in; the last is open."""
BATCH_ROWS_BIN_LABELS = ("0", "1", "2-3", "4-7", ">=8")
BATCH_BIN_PREFILL_SPLIT = "prefill_split"
"""``flip_rate_by_batch_rows``' bin for pairs whose prompts were split into other steps."""
