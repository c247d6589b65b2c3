"""kvtrace's typed tables, each declared once; their DDL, views and the writer's columns come from here.

A declaration lists each column with its ClickHouse type, codec and where its value comes from in a span
(a span field, an attribute named in ``semconv``, an event's field or attribute, a per-token array, or an
expression the database computes), with the sort key and which spans or events make the rows. Rendered
from it: the CREATE TABLE text, the materialized view that fills the table from ``otel_traces`` (the
Collector's path; ``schema.py`` runs both) and the Arrow columns ingest writes (``store.py``). Both paths
convert an attribute's text alike (``conversions.py``); ``tests/test_typed_ingest.py`` holds them to the
same rows.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple, Optional

from kvtrace import semconv as sc
from kvtrace.collectors.conversions import BY_TYPE, NUMBER_ARRAY_SQL, Conversion, or_instead, sql_string

# Where a column's value comes from (``Column.origin``).
SPAN = "span"                    # a field of the span's otel_traces row (``otlp_rows.SpanRow``)
ATTRIBUTE = "attribute"          # a span attribute's text, converted to the column's type
EVENT = "event"                  # a field of the event itself: ``EVENT_FIELDS``
EVENT_ATTRIBUTE = "event attribute"
TOKEN_ARRAY = "token array"      # numbers per token: packed in the spool, JSON text from a Collector
MATERIALIZED = "materialized"    # computed by the database from other columns

EVENT_FIELDS = {"time": "event_time", "name": "event", "index": "toUInt32(event_index - 1)"}
"""An event's own fields as the view reads them from its ``ARRAY JOIN`` (the index counted from 0)."""
_EVENTS_JOIN = ("ARRAY JOIN\n    Events.Timestamp AS event_time,\n    Events.Name AS event,\n"
                "    Events.Attributes AS ea,\n    arrayEnumerate(Events.Name) AS event_index\n")


class Column(NamedTuple):
    """One column of a typed table: ``origin`` says where in a span its value is (``SPAN`` …)."""

    name: str
    type: str
    origin: str
    source: str
    """The span field, attribute key, event field or SQL expression the value comes from."""
    codec: str = ""
    empty: Optional[str] = None
    """A text attribute's value where the span has none."""

    @property
    def value_type(self) -> str:
        """The type without ``LowCardinality``, which stores the same values."""
        return _value_type(self.type)

    @property
    def conversion(self) -> Conversion:
        return or_instead(self.empty) if self.empty is not None else BY_TYPE[self.value_type]


@functools.lru_cache(maxsize=None)  # read for every column of every batch
def _value_type(type_: str) -> str:
    return re.sub(r"LowCardinality\(([^()]*)\)", r"\1", type_)


class Table(NamedTuple):
    """A typed table: its columns in order, sort key, and the spans or events that make its rows."""

    name: str
    place: int
    """Where its DDL stands among ``collectors/sql``'s files (its view's at ``place + 1``)."""
    columns: tuple[Column, ...]
    order_by: str
    span_name: Optional[str] = None
    """One row per span of this name; else one per event whose name starts with ``event_prefix``."""
    event_prefix: Optional[str] = None
    comment: str = ""


def span(name: str, type_: str, field: Optional[str] = None, codec: str = "") -> Column:
    return Column(name, type_, SPAN, field or name, codec)


def attribute(name: str, type_: str, key: str, empty: Optional[str] = None) -> Column:
    return Column(name, type_, ATTRIBUTE, key, empty=empty)


def texts(type_: str, **keys: str) -> tuple[Column, ...]:
    """Text columns, each from the attribute its keyword names."""
    return tuple(attribute(name, type_, key) for name, key in keys.items())


STRING, LOW = "String", "LowCardinality(String)"
IDS, NUMBERS = "Array(Int64)", "Array(Float64)"
SPAN_IDS = (span("Timestamp", "DateTime64(9)", codec="Delta(8), ZSTD(1)"), span("TraceId", STRING),
            span("SpanId", STRING))
_CACHE_SOURCE = dict(source_span_id=sc.CACHE_SOURCE_SPAN_ID, source_trace_id=sc.CACHE_SOURCE_TRACE_ID,
                     source_request_id=sc.CACHE_SOURCE_REQUEST_ID, source_run_id=sc.CACHE_SOURCE_RUN_ID,
                     source_episode_id=sc.CACHE_SOURCE_EPISODE_ID)

REQUESTS = Table("kvtrace_requests", 10, (
    *SPAN_IDS, span("ParentSpanId", STRING), span("ServiceName", LOW),
    *texts(STRING, run_id=sc.RUN_ID, episode_id=sc.EPISODE_ID), attribute("turn", "Int32", sc.TURN),
    attribute("request_id", STRING, sc.REQUEST_ID),
    *texts(LOW, operation=sc.GEN_AI_OPERATION, engine=sc.ENGINE_NAME, engine_version=sc.ENGINE_VERSION),
    *texts(STRING, model=sc.GEN_AI_REQUEST_MODEL, model_fingerprint=sc.MODEL_FINGERPRINT),
    *texts(LOW, weight_format=sc.MODEL_WEIGHT_FORMAT, kv_cache_type=sc.KV_CACHE_TYPE, arm=sc.ARM,
           capture_mode=sc.CAPTURE_MODE),
    *texts(STRING, cache_settings=sc.CACHE_SETTINGS, numerics_settings=sc.NUMERICS_SETTINGS,
           sampling_settings=sc.SAMPLING_SETTINGS),
    attribute("prompt_tokens", "UInt32", sc.GEN_AI_USAGE_INPUT_TOKENS),
    attribute("prompt_hash", STRING, sc.PROMPT_HASH),
    attribute("prompt_hash_source", LOW, sc.PROMPT_HASH_SOURCE),
    attribute("prompt_block_hashes", "Array(String)", sc.PROMPT_BLOCK_HASHES),
    attribute("block_layers", "Array(LowCardinality(String))", sc.PROMPT_BLOCK_LAYERS),
    attribute("cache_layer", LOW, sc.CACHE_LAYER, empty=sc.LAYER_NONE),
    *(attribute(f"{what}_tokens", "UInt32", key) for what, key in (
        ("reused", sc.CACHE_REUSED_TOKENS), ("recomputed", sc.CACHE_RECOMPUTED_TOKENS),
        ("replayed", sc.CACHE_REPLAYED_TOKENS))),
    attribute("reused_tokens_source", LOW, sc.CACHE_REUSED_TOKENS_SOURCE),
    *texts(STRING, state_key=sc.CACHE_STATE_KEY, **_CACHE_SOURCE),
    attribute("source_turn", "Int32", sc.CACHE_SOURCE_TURN),
    attribute("hit_block_hashes", "Array(String)", sc.CACHE_HIT_BLOCK_HASHES),
    attribute("output_tokens", "UInt32", sc.GEN_AI_USAGE_OUTPUT_TOKENS),
    attribute("output_hash", STRING, sc.OUTPUT_HASH),
    attribute("token_id_source", LOW, sc.OUTPUT_TOKEN_ID_SOURCE),
    # Read several times faster than LZ4: T64 packs small token ids; no general codec shrinks margins.
    *(Column(name, IDS, TOKEN_ARRAY, key, "T64") for name, key in (
        ("token_ids", sc.OUTPUT_TOKEN_IDS), ("top1_ids", sc.OUTPUT_TOP1_IDS),
        ("runner_up_ids", sc.OUTPUT_RUNNER_UP_IDS))),
    Column("margins", NUMBERS, TOKEN_ARRAY, sc.OUTPUT_MARGINS, "NONE"),
    Column("logprobs", NUMBERS, TOKEN_ARRAY, sc.OUTPUT_LOGPROBS, "NONE"),
    # Equal arrays, equal digests: queries find which outputs differ without reading or joining the arrays.
    Column("token_digest", "UInt64", MATERIALIZED, "cityHash64(token_ids)"),
    attribute("finish_reason", LOW, sc.OUTPUT_FINISH_REASON),
    span("status_code", LOW, "StatusCode"), span("duration_ns", "UInt64", "Duration"),
    # Batch composition (docs/batching.md): per generated token the rows and tokens of its engine step; the
    # prompt's computed tokens per step.
    attribute("batch_composition", LOW, sc.BATCH_COMPOSITION),
    *(Column(name, IDS, TOKEN_ARRAY, key, "T64") for name, key in (
        ("step_rows", sc.OUTPUT_STEP_ROWS), ("step_tokens", sc.OUTPUT_STEP_TOKENS),
        ("prefill_steps", sc.PROMPT_PREFILL_STEPS))),
    # How llama-server chose the request's slot (docs/proxy.md): by similarity, or a cold one by LRU.
    attribute("slot_selected_by", LOW, sc.SERVER_SLOT_SELECTED_BY),
    # Where the per-token arrays stop short of the token ids, and why (0 and '' where they do not).
    attribute("rows_cut_at", "UInt32", sc.OUTPUT_ROWS_CUT_AT),
    attribute("rows_cut_reason", LOW, sc.OUTPUT_ROWS_CUT_REASON),
), "run_id, episode_id, turn, Timestamp, TraceId, SpanId", span_name=sc.SPAN_REQUEST,
    comment="one row per generation request (one kvtrace.request span), the per-token arrays as columns")

CACHE_EVENTS = Table("kvtrace_cache_events", 14, (
    Column("Timestamp", "DateTime64(9)", EVENT, "time", "Delta(8), ZSTD(1)"), *SPAN_IDS[1:],
    *texts(STRING, run_id=sc.RUN_ID, episode_id=sc.EPISODE_ID), attribute("turn", "Int32", sc.TURN),
    attribute("request_id", STRING, sc.REQUEST_ID), attribute("engine", LOW, sc.ENGINE_NAME),
    Column("event", LOW, EVENT, "name"), Column("event_index", "UInt32", EVENT, "index"),
    *(Column(name, type_, EVENT_ATTRIBUTE, key) for name, type_, key in (
        ("layer", LOW, sc.EVENT_LAYER), ("outcome", LOW, sc.EVENT_OUTCOME), ("key_hash", STRING, sc.EVENT_KEY_HASH),
        ("tokens", "UInt32", sc.EVENT_TOKENS), ("prefix_tokens", "UInt32", sc.EVENT_PREFIX_TOKENS),
        ("entries_scanned", "UInt32", sc.EVENT_ENTRIES_SCANNED), ("size_bytes", "UInt64", sc.EVENT_SIZE_BYTES),
        ("reason", STRING, sc.EVENT_REASON), ("block_hashes", "Array(String)", sc.EVENT_BLOCK_HASHES),
        ("block_ids", IDS, sc.EVENT_BLOCK_IDS), ("parent_hash", STRING, sc.EVENT_PARENT_HASH),
        ("source_span_id", STRING, sc.EVENT_SOURCE_SPAN_ID), ("source_trace_id", STRING, sc.EVENT_SOURCE_TRACE_ID),
        ("source_request_id", STRING, sc.EVENT_SOURCE_REQUEST_ID), ("source_run_id", STRING, sc.EVENT_SOURCE_RUN_ID),
        ("source_episode_id", STRING, sc.EVENT_SOURCE_EPISODE_ID), ("source_turn", "Int32", sc.EVENT_SOURCE_TURN),
        ("source_time_unix_nano", "UInt64", sc.EVENT_SOURCE_TIME))),
), "run_id, episode_id, turn, Timestamp, TraceId, SpanId, event_index", event_prefix=sc.CACHE_EVENT_PREFIX,
    comment="one row per cache event (lookup, reuse, restore, store, evict, reset)")

TYPED_TABLES = (REQUESTS, CACHE_EVENTS)
TOKEN_ARRAYS = {c.source: c.name for c in REQUESTS.columns if c.origin == TOKEN_ARRAY}
"""The per-token arrays ingest reads as numbers: attribute key → ``kvtrace_requests`` column."""


def create_table(table: Table) -> str:
    """The table's CREATE TABLE text (``${name}`` placeholders for ``schema.py``).

    One row per span (and event) whatever path stored it and how often: the sort key ends with the span's
    ids, so the engine folds copies into one and queries read FINAL. Ordered by run first: two runs are read
    without the rest of the table."""
    lines = [f"    {c.name} {c.type}" + (f" MATERIALIZED {c.source}" if c.origin == MATERIALIZED else "")
             + (f" CODEC({c.codec})" if c.codec else "") for c in table.columns]
    return (f"-- {table.name}: {table.comment}.\n"
            f"CREATE TABLE IF NOT EXISTS ${{database}}.${{{table.name}}} ${{on_cluster}} (\n" + ",\n".join(lines)
            + f"\n) ENGINE = ${{span_engine}}\nPARTITION BY toDate(Timestamp)\nORDER BY ({table.order_by})\n")


def create_view(table: Table) -> str:
    """The materialized view that fills ``table`` from ``otel_traces``, where attributes are text: the
    Collector's path. Spans ingest stored carry ``TYPED_ROWS_STORED`` (it wrote their rows itself)."""
    selected = ",\n".join(f"    {_select(c)}" for c in table.columns if c.origin != MATERIALIZED)
    typed = f"NOT mapContains(SpanAttributes, {sql_string(sc.TYPED_ROWS_STORED)})"
    where = (f"{_EVENTS_JOIN}WHERE startsWith(event, {sql_string(table.event_prefix)}) AND {typed}"
             if table.event_prefix else f"WHERE SpanName = {sql_string(table.span_name)}\n    AND {typed}")
    return (f"-- Fills {table.name} from otel_traces: the Collector's path.\n"
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS ${{database}}.${{{table.name}_mv}} ${{on_cluster}}\n"
            f"TO ${{database}}.${{{table.name}}}\nAS SELECT\n{selected}\n"
            f"FROM ${{database}}.${{otel_traces}}\n{where}\n")


def _select(column: Column) -> str:
    if column.origin == SPAN:
        expression = column.source
    elif column.origin == EVENT:
        expression = EVENT_FIELDS[column.source]
    elif column.origin == TOKEN_ARRAY:
        expression = NUMBER_ARRAY_SQL[column.type].format(f"SpanAttributes[{sql_string(column.source)}]")
    else:
        text = f"{'ea' if column.origin == EVENT_ATTRIBUTE else 'SpanAttributes'}[{sql_string(column.source)}]"
        expression = column.conversion.sql.format(text)
    return expression if expression == column.name else f"{expression} AS {column.name}"


def rendered(tables: tuple[Table, ...] = TYPED_TABLES) -> list[tuple[str, str]]:
    """Each table's DDL and view as ``collectors/sql`` names its files, for ``schema.py``."""
    return [text for t in tables for text in ((f"{t.place:02d}_{t.name}.sql", create_table(t)),
                                              (f"{t.place + 1:02d}_{t.name}_mv.sql", create_view(t)))]
