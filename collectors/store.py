"""Rows of spans (``otlp_rows``, read typed) → kvtrace's tables and ``otel_traces``, as Arrow columns.

The one write path of ingest and of the ClickHouse exporter. ``kvtrace_requests`` gets one row per
request span, its per-token arrays as Array columns (numpy concatenations and offsets, no Python
work per number; a negative zero stored as 0, as the Collector's text "-0" reads back);
``kvtrace_tokens`` is a view of them. ``kvtrace_cache_events`` gets one row per ``kvtrace.cache.*``
event. Columns are computed from the attributes as ``11_kvtrace_requests_mv.sql`` and
``15_kvtrace_cache_events_mv.sql`` compute them from a Collector's rows (``tests/test_typed_ingest.py``
holds the two to the same rows). Every table is built before the first insert, so a value Arrow
cannot carry stops the batch before anything of it is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from itertools import chain

import msgspec
import numpy as np
import pyarrow as pa

from kvtrace import semconv as sc
from kvtrace.collectors.otlp_rows import COLUMNS, SpanRow

_SIGNED, _UNSIGNED = re.compile(r"[+-]?\d+"), re.compile(r"\+?\d+")
_STRINGS = msgspec.json.Decoder(list[str]).decode


def _integer(text: str, pattern: re.Pattern, low: int, high: int, default: int) -> int:
    """``toInt32OrDefault`` / ``toUInt32OrZero`` / ``toUInt64OrZero``: the text's integer in the type, else default."""
    value = int(text) if (text.isascii() and text.isdigit()) or pattern.fullmatch(text) else default
    return value if low <= value <= high else default


def _json_array(text: str, element: type, default) -> list:
    """``JSONExtract(text, 'Array(String)')`` / ``'Array(Int64)'``: elements of another type as default."""
    if element is str:
        try:
            return _STRINGS(text) if text else []
        except msgspec.MsgspecError:
            pass
    try:
        values = json.loads(text) if text else []
    except ValueError:
        return []
    return [v if type(v) is element else default for v in values] if isinstance(values, list) else []


TEXT, INT32, UINT32, UINT64, STRINGS, INT64S, LAYER = "s", "i32", "u32", "u64", ("list", "s"), ("list", "i64"), "layer"
_CONVERT = {
    INT32: lambda t: _integer(t, _SIGNED, -2**31, 2**31 - 1, -1), UINT32: lambda t: _integer(t, _UNSIGNED, 0, 2**32 - 1, 0),
    UINT64: lambda t: _integer(t, _UNSIGNED, 0, 2**64 - 1, 0), STRINGS: lambda t: _json_array(t, str, ""),
    INT64S: lambda t: _json_array(t, int, 0), LAYER: lambda t: t or sc.LAYER_NONE,
}
REQUEST_ATTRIBUTES = [
    ("run_id", sc.RUN_ID, TEXT), ("episode_id", sc.EPISODE_ID, TEXT), ("turn", sc.TURN, INT32),
    ("request_id", sc.REQUEST_ID, TEXT), ("operation", sc.GEN_AI_OPERATION, TEXT), ("engine", sc.ENGINE_NAME, TEXT),
    ("engine_version", sc.ENGINE_VERSION, TEXT), ("model", sc.GEN_AI_REQUEST_MODEL, TEXT),
    ("model_fingerprint", sc.MODEL_FINGERPRINT, TEXT), ("weight_format", sc.MODEL_WEIGHT_FORMAT, TEXT),
    ("kv_cache_type", sc.KV_CACHE_TYPE, TEXT), ("arm", sc.ARM, TEXT), ("capture_mode", sc.CAPTURE_MODE, TEXT),
    ("cache_settings", sc.CACHE_SETTINGS, TEXT), ("numerics_settings", sc.NUMERICS_SETTINGS, TEXT),
    ("sampling_settings", sc.SAMPLING_SETTINGS, TEXT), ("prompt_tokens", sc.GEN_AI_USAGE_INPUT_TOKENS, UINT32),
    ("prompt_hash", sc.PROMPT_HASH, TEXT), ("prompt_hash_source", sc.PROMPT_HASH_SOURCE, TEXT),
    ("prompt_block_hashes", sc.PROMPT_BLOCK_HASHES, STRINGS), ("block_layers", sc.PROMPT_BLOCK_LAYERS, STRINGS),
    ("cache_layer", sc.CACHE_LAYER, LAYER), ("reused_tokens", sc.CACHE_REUSED_TOKENS, UINT32),
    ("recomputed_tokens", sc.CACHE_RECOMPUTED_TOKENS, UINT32), ("replayed_tokens", sc.CACHE_REPLAYED_TOKENS, UINT32),
    ("reused_tokens_source", sc.CACHE_REUSED_TOKENS_SOURCE, TEXT), ("state_key", sc.CACHE_STATE_KEY, TEXT),
    ("source_span_id", sc.CACHE_SOURCE_SPAN_ID, TEXT), ("source_trace_id", sc.CACHE_SOURCE_TRACE_ID, TEXT),
    ("source_request_id", sc.CACHE_SOURCE_REQUEST_ID, TEXT), ("source_run_id", sc.CACHE_SOURCE_RUN_ID, TEXT),
    ("source_episode_id", sc.CACHE_SOURCE_EPISODE_ID, TEXT), ("source_turn", sc.CACHE_SOURCE_TURN, INT32),
    ("hit_block_hashes", sc.CACHE_HIT_BLOCK_HASHES, STRINGS), ("output_tokens", sc.GEN_AI_USAGE_OUTPUT_TOKENS, UINT32),
    ("output_hash", sc.OUTPUT_HASH, TEXT), ("token_id_source", sc.OUTPUT_TOKEN_ID_SOURCE, TEXT),
    ("finish_reason", sc.OUTPUT_FINISH_REASON, TEXT)]
"""``kvtrace_requests``' columns read from a request span's attributes: (column, attribute, kind)."""
EVENT_SPAN_ATTRIBUTES = [("run_id", sc.RUN_ID, TEXT), ("episode_id", sc.EPISODE_ID, TEXT), ("turn", sc.TURN, INT32),
                         ("request_id", sc.REQUEST_ID, TEXT), ("engine", sc.ENGINE_NAME, TEXT)]
EVENT_ATTRIBUTES = [
    ("layer", sc.EVENT_LAYER, TEXT), ("outcome", sc.EVENT_OUTCOME, TEXT), ("key_hash", sc.EVENT_KEY_HASH, TEXT),
    ("tokens", sc.EVENT_TOKENS, UINT32), ("prefix_tokens", sc.EVENT_PREFIX_TOKENS, UINT32),
    ("entries_scanned", sc.EVENT_ENTRIES_SCANNED, UINT32), ("size_bytes", sc.EVENT_SIZE_BYTES, UINT64),
    ("reason", sc.EVENT_REASON, TEXT), ("block_hashes", sc.EVENT_BLOCK_HASHES, STRINGS),
    ("block_ids", sc.EVENT_BLOCK_IDS, INT64S), ("parent_hash", sc.EVENT_PARENT_HASH, TEXT),
    ("source_span_id", sc.EVENT_SOURCE_SPAN_ID, TEXT), ("source_trace_id", sc.EVENT_SOURCE_TRACE_ID, TEXT),
    ("source_request_id", sc.EVENT_SOURCE_REQUEST_ID, TEXT), ("source_run_id", sc.EVENT_SOURCE_RUN_ID, TEXT),
    ("source_episode_id", sc.EVENT_SOURCE_EPISODE_ID, TEXT), ("source_turn", sc.EVENT_SOURCE_TURN, INT32),
    ("source_time_unix_nano", sc.EVENT_SOURCE_TIME, UINT64)]
"""``kvtrace_cache_events``' columns read from the span (``EVENT_SPAN_ATTRIBUTES``) and from the event."""

_ARRAY_TYPES = {"token_ids": "i64", "top1_ids": "i64", "runner_up_ids": "i64", "margins": "f64", "logprobs": "f64"}
OTEL_KINDS = ["t", *["s"] * 7, "map", "s", "s", "map", "u64", "s", "s", ("list", "t"), ("list", "s"), ("list", "map"),
              *[("list", "s")] * 3, ("list", "map")]
"""Kinds of ``COLUMNS``."""
_NUMERIC = {"t": (np.int64, pa.timestamp("ns")), "i32": (np.int32, pa.int32()), "u32": (np.uint32, pa.uint32()),
            "u64": (np.uint64, pa.uint64()), "i64": (np.int64, pa.int64()), "f64": (np.float64, pa.float64())}


def arrow(values: list, kind) -> pa.Array:
    """``values`` as an Arrow array of ``kind`` ("s", a ``_NUMERIC`` key, "map" of text, ``("list", kind)``),
    built from buffers: ``pa.array`` would import pandas (half a CPU-second) on its first call."""
    if kind == "s":
        builder = pa.lib.StringBuilder()
        builder.append_values(values)
        return builder.finish()
    if kind == "map":
        return pa.MapArray.from_arrays(_offsets(list(map(len, values))), arrow(list(chain.from_iterable(values)), "s"),
                                       arrow(list(chain.from_iterable(m.values() for m in values)), "s"))
    if isinstance(kind, tuple):
        return pa.ListArray.from_arrays(_offsets(list(map(len, values))), arrow(list(chain.from_iterable(values)), kind[1]))
    return _buffer(np.asarray(values, _NUMERIC[kind][0]), kind)


def _buffer(data: np.ndarray, kind: str) -> pa.Array:
    return pa.Array.from_buffers(_NUMERIC[kind][1], len(data), [None, pa.py_buffer(data)])


def _offsets(lengths) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return _buffer(offsets, "i32")


def _list_column(arrays: list[np.ndarray], kind: str) -> pa.Array:
    """One Array column from per-row numpy arrays: their concatenation and offsets, no per-number work."""
    dtype = _NUMERIC[kind][0]
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    if kind == "f64":
        values = values + 0.0  # -0.0 + 0.0 is 0.0: a negative zero is stored as 0
    return pa.ListArray.from_arrays(_offsets([len(a) for a in arrays]), _buffer(values, kind))


def _columns(spec, attributes: list[dict]) -> dict[str, pa.Array]:
    columns = {}
    for column, key, kind in spec:
        texts = [a.get(key, "") for a in attributes]
        convert = _CONVERT.get(kind)
        columns[column] = arrow(texts if convert is None else list(map(convert, texts)), TEXT if kind == LAYER else kind)
    return columns


def _table(columns: dict[str, pa.Array]) -> pa.Table:
    return pa.Table.from_arrays(list(columns.values()), names=list(columns))


def request_table(requests: list[SpanRow]) -> pa.Table:
    """``kvtrace_requests`` rows of request spans read typed."""
    columns = {name: arrow([row[COLUMNS.index(name)] for row in requests], "t" if name == "Timestamp" else "s")
               for name in ("Timestamp", "TraceId", "SpanId", "ParentSpanId", "ServiceName")}
    columns.update(_columns(REQUEST_ATTRIBUTES, [row[11] for row in requests]))
    columns["status_code"] = arrow([row[13] for row in requests], "s")
    columns["duration_ns"] = arrow([row[12] for row in requests], "u64")
    empty = np.zeros(0, np.int64)
    for column, kind in _ARRAY_TYPES.items():
        columns[column] = _list_column([row.arrays.get(column, empty) for row in requests], kind)
    return _table(columns)


def cache_event_table(rows: list[SpanRow]) -> pa.Table:
    """``kvtrace_cache_events`` rows: one per ``kvtrace.cache.*`` event of ``rows``."""
    found = [(row, index) for row in rows for index, name in enumerate(row[16])
             if name.startswith(sc.CACHE_EVENT_PREFIX)]
    columns = {"Timestamp": arrow([row[15][i] for row, i in found], "t"),
               "TraceId": arrow([row[1] for row, _ in found], "s"), "SpanId": arrow([row[2] for row, _ in found], "s")}
    columns.update(_columns(EVENT_SPAN_ATTRIBUTES, [row[11] for row, _ in found]))
    columns["event"] = arrow([row[16][i] for row, i in found], "s")
    columns["event_index"] = arrow([i for _, i in found], "u32")
    columns.update(_columns(EVENT_ATTRIBUTES, [row[17][i] for row, i in found]))
    return _table(columns)


def otel_table(rows: list[SpanRow]) -> pa.Table:
    return _table({name: arrow([row[i] for row in rows], kind) for i, (name, kind) in enumerate(zip(COLUMNS, OTEL_KINDS))})


def store_rows(client, rows: list[SpanRow], token: str) -> None:
    """Write ``rows`` (read typed): typed tables first, then ``otel_traces`` deduplicated by ``token`` (a hash
    of what the rows came from), so a batch written again after a stop stores its spans once."""
    if not rows:
        return
    tables = {"kvtrace_requests": request_table([row for row in rows if row.arrays is not None]),
              "kvtrace_cache_events": cache_event_table(rows),
              "otel_traces": otel_table(rows)}
    for name, table in tables.items():
        if table.num_rows:
            # Typed tables fold copies when they merge and queries read FINAL: folding each block on insert as
            # well (the engine's default) costs a third of storing them, for no answer changed.
            settings = ({"insert_deduplication_token": f"{name}:{token}"} if name == "otel_traces" else
                        {"optimize_on_insert": 0})
            client.insert_arrow(name, table, settings=settings)


def batch_token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
