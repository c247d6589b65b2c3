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
import math
import re
from decimal import Decimal
from itertools import chain
from typing import Callable, NamedTuple, Optional

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace import semconv as sc
from kvtrace.collectors.otlp_rows import COLUMNS, SpanRow

# ASCII digits only, as ClickHouse reads them ("٣" and "１２" are its default, not 3 and 12).
_SIGNED, _UNSIGNED = re.compile(r"[+-]?[0-9]+"), re.compile(r"\+?[0-9]+")
_STRINGS = msgspec.json.Decoder(list[str]).decode
_INTEGERS = msgspec.json.Decoder(list[int]).decode


class Conversion(NamedTuple):
    """An attribute's text → a typed column (``arrow``'s kind), as ClickHouse's function of the same name does."""

    convert: Callable[[str], object]
    kind: object
    bounds: Optional[tuple[int, int, int]] = None
    """An integer's (lowest, highest, default): a column of plain digits is converted in Arrow."""


def _integer(pattern: re.Pattern, low: int, high: int, default: int, kind: str) -> Conversion:
    def convert(text: str) -> int:
        value = int(text) if (text.isascii() and text.isdigit()) or pattern.fullmatch(text) else default
        return value if low <= value <= high else default
    return Conversion(convert, kind, (low, high, default))


def _json_array(element: type) -> Callable[[str], list]:
    """JSON array text → its elements as ``JSONExtract(…, 'Array(String)')`` or ``'Array(Int64)'`` reads them:
    an element of another JSON type is converted (a number's text, a numeric string's value), never a reason
    to refuse the span. Text that is no JSON array, or holds a number past a double's range, is an empty array."""
    fast, each = (_STRINGS, _element_text) if element is str else (_INTEGERS, _element_integer)

    def convert(text: str) -> list:
        if not text:
            return []
        try:  # the common case (hashes, ids as written by kvtrace), decoded in C
            values = fast(text)
            if element is str or not values or (-2**63 <= min(values) and max(values) < 2**63):
                return values
        except msgspec.MsgspecError:
            pass
        try:
            values = json.loads(text, parse_constant=_finite, parse_float=_finite)
            return [each(v) for v in values] if isinstance(values, list) else []
        except ValueError:  # not JSON, or a number JSON cannot hold (NaN, 1e400)
            return []
    return convert


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _element_text(value) -> str:
    """An element as ClickHouse writes it into Array(String): a string as itself, anything else as compact JSON."""
    return value if isinstance(value, str) else "" if value is None else _json_text(value)


def _json_text(value) -> str:
    if isinstance(value, float):
        return _number_text(value)
    if isinstance(value, list):
        return "[" + ",".join(map(_json_text, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + _json_text(v) for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)  # str, int, bool, None


def _number_text(value: float) -> str:
    """The shortest digits that read back as ``value``, in fixed notation from 1e-6 to below 1e21 and as
    ``1.5e-7`` outside it (ECMAScript's rule, which ClickHouse follows, less the exponent's "+")."""
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    text = "".join(map(str, digits))
    point = len(text) + exponent  # digits before the decimal point
    if -6 < point <= 21:
        text = (text + "0" * exponent if exponent >= 0 else
                text[:point] + "." + text[point:] if point > 0 else "0." + "0" * -point + text)
    else:
        text = text[0] + ("." + text[1:] if len(text) > 1 else "") + f"e{point - 1}"
    return "-" * sign + text


_DECIMAL = re.compile(r"[+-]?[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?")


def _element_integer(value) -> int:
    """An element as ClickHouse reads it into Array(Int64): a number (or a string holding one) truncated,
    0 for anything else or outside Int64."""
    if isinstance(value, str):
        if not _DECIMAL.fullmatch(value):
            return 0
        value = int(value) if value.lstrip("+-").isdigit() else float(value)
    if isinstance(value, int) and not -2**63 <= value < 2**64:  # bool is an int
        value = float(value) if value.bit_length() <= 1024 else 0.0  # past UInt64, JSON's parser reads a double
    if isinstance(value, float):
        return int(value) if -2**63 <= value < 2**63 else 0  # NaN and infinities are outside
    return int(value) if isinstance(value, int) and value < 2**63 else 0


TEXT = Conversion(str, "s")
INT32_OR_MINUS_1 = _integer(_SIGNED, -2**31, 2**31 - 1, -1, "i32")  # toInt32OrDefault(…, -1)
UINT32_OR_ZERO = _integer(_UNSIGNED, 0, 2**32 - 1, 0, "u32")
UINT64_OR_ZERO = _integer(_UNSIGNED, 0, 2**64 - 1, 0, "u64")
STRINGS = Conversion(_json_array(str), ("list", "s"))  # JSONExtract(…, 'Array(String)')
INT64S = Conversion(_json_array(int), ("list", "i64"))
LAYER = Conversion(lambda text: text or sc.LAYER_NONE, "s")


def _text(columns: dict[str, str]) -> list[tuple[str, str, Conversion]]:
    return [(column, key, TEXT) for column, key in columns.items()]


REQUEST_ATTRIBUTES = [*_text({
    "run_id": sc.RUN_ID, "episode_id": sc.EPISODE_ID, "request_id": sc.REQUEST_ID, "operation": sc.GEN_AI_OPERATION,
    "engine": sc.ENGINE_NAME, "engine_version": sc.ENGINE_VERSION, "model": sc.GEN_AI_REQUEST_MODEL,
    "model_fingerprint": sc.MODEL_FINGERPRINT, "weight_format": sc.MODEL_WEIGHT_FORMAT, "kv_cache_type": sc.KV_CACHE_TYPE,
    "arm": sc.ARM, "capture_mode": sc.CAPTURE_MODE, "cache_settings": sc.CACHE_SETTINGS,
    "numerics_settings": sc.NUMERICS_SETTINGS, "sampling_settings": sc.SAMPLING_SETTINGS, "prompt_hash": sc.PROMPT_HASH,
    "prompt_hash_source": sc.PROMPT_HASH_SOURCE, "reused_tokens_source": sc.CACHE_REUSED_TOKENS_SOURCE,
    "state_key": sc.CACHE_STATE_KEY, "source_span_id": sc.CACHE_SOURCE_SPAN_ID, "source_trace_id": sc.CACHE_SOURCE_TRACE_ID,
    "source_request_id": sc.CACHE_SOURCE_REQUEST_ID, "source_run_id": sc.CACHE_SOURCE_RUN_ID,
    "source_episode_id": sc.CACHE_SOURCE_EPISODE_ID, "output_hash": sc.OUTPUT_HASH,
    "token_id_source": sc.OUTPUT_TOKEN_ID_SOURCE, "finish_reason": sc.OUTPUT_FINISH_REASON,
    "batch_composition": sc.BATCH_COMPOSITION}),
    ("turn", sc.TURN, INT32_OR_MINUS_1), ("source_turn", sc.CACHE_SOURCE_TURN, INT32_OR_MINUS_1),
    ("prompt_tokens", sc.GEN_AI_USAGE_INPUT_TOKENS, UINT32_OR_ZERO), ("reused_tokens", sc.CACHE_REUSED_TOKENS, UINT32_OR_ZERO),
    ("recomputed_tokens", sc.CACHE_RECOMPUTED_TOKENS, UINT32_OR_ZERO),
    ("replayed_tokens", sc.CACHE_REPLAYED_TOKENS, UINT32_OR_ZERO),
    ("output_tokens", sc.GEN_AI_USAGE_OUTPUT_TOKENS, UINT32_OR_ZERO), ("cache_layer", sc.CACHE_LAYER, LAYER),
    ("prompt_block_hashes", sc.PROMPT_BLOCK_HASHES, STRINGS), ("block_layers", sc.PROMPT_BLOCK_LAYERS, STRINGS),
    ("hit_block_hashes", sc.CACHE_HIT_BLOCK_HASHES, STRINGS)]
"""``kvtrace_requests``' columns read from a request span's attributes: (column, attribute, conversion)."""

EVENT_SPAN_ATTRIBUTES = [*_text({"run_id": sc.RUN_ID, "episode_id": sc.EPISODE_ID, "request_id": sc.REQUEST_ID,
                                 "engine": sc.ENGINE_NAME}), ("turn", sc.TURN, INT32_OR_MINUS_1)]
EVENT_ATTRIBUTES = [*_text({
    "layer": sc.EVENT_LAYER, "outcome": sc.EVENT_OUTCOME, "key_hash": sc.EVENT_KEY_HASH, "reason": sc.EVENT_REASON,
    "parent_hash": sc.EVENT_PARENT_HASH, "source_span_id": sc.EVENT_SOURCE_SPAN_ID,
    "source_trace_id": sc.EVENT_SOURCE_TRACE_ID, "source_request_id": sc.EVENT_SOURCE_REQUEST_ID,
    "source_run_id": sc.EVENT_SOURCE_RUN_ID, "source_episode_id": sc.EVENT_SOURCE_EPISODE_ID}),
    ("tokens", sc.EVENT_TOKENS, UINT32_OR_ZERO), ("prefix_tokens", sc.EVENT_PREFIX_TOKENS, UINT32_OR_ZERO),
    ("entries_scanned", sc.EVENT_ENTRIES_SCANNED, UINT32_OR_ZERO), ("size_bytes", sc.EVENT_SIZE_BYTES, UINT64_OR_ZERO),
    ("block_hashes", sc.EVENT_BLOCK_HASHES, STRINGS), ("block_ids", sc.EVENT_BLOCK_IDS, INT64S),
    ("source_turn", sc.EVENT_SOURCE_TURN, INT32_OR_MINUS_1),
    ("source_time_unix_nano", sc.EVENT_SOURCE_TIME, UINT64_OR_ZERO)]
"""``kvtrace_cache_events``' columns read from the span (``EVENT_SPAN_ATTRIBUTES``) and from the event."""

_ARRAY_TYPES = {"token_ids": "i64", "top1_ids": "i64", "runner_up_ids": "i64", "margins": "f64", "logprobs": "f64",
                "step_rows": "i64", "step_tokens": "i64", "prefill_steps": "i64"}
OTEL_KINDS = ["t", *["s"] * 7, "map", "s", "s", "map", "u64", "s", "s", ("list", "t"), ("list", "s"), ("list", "map"),
              *[("list", "s")] * 3, ("list", "map")]
"""Kinds of ``COLUMNS``."""
_NUMERIC = {"t": (np.int64, pa.timestamp("ns")), "i32": (np.int32, pa.int32()), "u32": (np.uint32, pa.uint32()),
            "u64": (np.uint64, pa.uint64()), "i64": (np.int64, pa.int64()), "f64": (np.float64, pa.float64())}


def arrow(values: list, kind) -> pa.Array:
    """``values`` as an Arrow array of ``kind`` ("s", a ``_NUMERIC`` key, "map" of text, ``("list", kind)``),
    built from buffers: ``pa.array`` (and a Python scalar in a compute call) would import pandas, half a
    CPU-second, into an engine's process too when it exports to ClickHouse."""
    if kind == "s":
        return _strings(values)
    if kind == "map":
        return pa.MapArray.from_arrays(_offsets(list(map(len, values))), arrow(list(chain.from_iterable(values)), "s"),
                                       arrow(list(chain.from_iterable(m.values() for m in values)), "s"))
    if isinstance(kind, tuple):
        return pa.ListArray.from_arrays(_offsets(list(map(len, values))), arrow(list(chain.from_iterable(values)), kind[1]))
    return _buffer(np.asarray(values, _NUMERIC[kind][0]), kind)


def _strings(values: list[str]) -> pa.Array:
    """ASCII text (nearly all of it) from one join and the strings' lengths, twice as fast as Arrow's
    builder, which takes the rest."""
    try:
        joined = "".join(values)
        data = joined.encode()
    except (TypeError, UnicodeEncodeError):  # not all text, or a lone surrogate: the builder says what is wrong
        joined, data = "", b"?"
    if len(data) != len(joined) or len(data) >= 2**31:
        builder = pa.lib.StringBuilder()
        builder.append_values(values)
        return builder.finish()
    return pa.StringArray.from_buffers(len(values), _offsets(list(map(len, values))).buffers()[1], pa.py_buffer(data))


def _numpy(array: pa.Array, dtype, extra: int = 0) -> np.ndarray:
    """A null-free array's values buffer (a string array's offsets, with ``extra=1``) as numpy, not copied."""
    return np.frombuffer(array.buffers()[1], dtype)[array.offset: array.offset + len(array) + extra]


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


class _Attributes:
    """The rows' attribute maps flattened once: ``otel_traces``' Map column, and typed columns of chosen rows
    taken from it by key (numpy and Arrow, no Python work per value where the text is plain)."""

    def __init__(self, maps: list[dict[str, str]]):
        self.map = arrow(maps, "map")
        self._row_of = np.repeat(np.arange(len(maps)), np.diff(_numpy(self.map.offsets, np.int32)))  # each entry's map
        self._rows = len(maps)
        encoded = self.map.keys.dictionary_encode()
        self._key_names = encoded.dictionary.to_pylist()  # the distinct keys, and each entry's index among them
        self._key_codes = _numpy(encoded.indices, np.int32)
        self._texts = pa.concat_arrays([self.map.items, _strings([""])])  # the last: where a row lacks the key

    def columns(self, spec, rows: np.ndarray) -> dict[str, pa.Array]:
        """``spec``'s columns of ``rows`` (indices of the maps), a missing key's text read as ""."""
        wanted = {key: i for i, (_, key, _) in enumerate(spec)}
        code_of = np.array([wanted.get(key, -1) for key in self._key_names], np.int64)
        codes = code_of[self._key_codes] if len(code_of) else np.zeros(0, np.int64)
        missing = len(self._texts) - 1
        out = {}
        for i, (column, _, how) in enumerate(spec):
            where = np.full(self._rows, missing, np.int64)
            entries = np.flatnonzero(codes == i)
            where[self._row_of[entries]] = entries  # a map holds a key once
            out[column] = _typed(self._texts.take(_buffer(where[rows], "i64")), how)
        return out


def _typed(texts: pa.Array, how: Conversion) -> pa.Array:
    if how is TEXT:
        return texts
    if how.bounds:
        integers = _plain_integers(texts, *how.bounds)
        if integers is not None:
            return _buffer(integers.astype(_NUMERIC[how.kind][0]), how.kind)
    return arrow([how.convert(text) for text in texts.to_pylist()], how.kind)


def _plain_integers(texts: pa.Array, low: int, high: int, default: int) -> Optional[np.ndarray]:
    """Texts that are all empty or up to 18 ASCII digits (which int64 holds) as integers, outside
    ``low``..``high`` or empty the default; None for any other text."""
    if not len(texts):
        return np.zeros(0, np.int64)
    present = np.flatnonzero(np.diff(_numpy(texts, np.int32, extra=1)))
    digits = texts.take(_buffer(present, "i64"))
    if len(present) and not pc.all(pc.match_substring_regex(digits, "^[0-9]{1,18}$")).as_py():
        return None
    out = np.full(len(texts), default, np.int64)
    if len(present):
        parsed = _numpy(pc.cast(digits, pa.int64()), np.int64)
        out[present] = np.where((parsed >= low) & (parsed <= min(high, 2**63 - 1)), parsed, default)
    return out


def _table(columns: dict[str, pa.Array]) -> pa.Table:
    return pa.Table.from_arrays(list(columns.values()), names=list(columns))


def request_table(rows: list[SpanRow], attributes: _Attributes) -> pa.Table:
    """``kvtrace_requests`` rows of the request spans among ``rows`` (read typed; ``attributes``: theirs)."""
    indices = np.array([i for i, row in enumerate(rows) if row.arrays is not None], np.int64)
    requests = [rows[i] for i in indices]
    columns = {name: arrow([row[COLUMNS.index(name)] for row in requests], "t" if name == "Timestamp" else "s")
               for name in ("Timestamp", "TraceId", "SpanId", "ParentSpanId", "ServiceName")}
    columns.update(attributes.columns(REQUEST_ATTRIBUTES, indices))
    columns["status_code"] = arrow([row[13] for row in requests], "s")
    columns["duration_ns"] = arrow([row[12] for row in requests], "u64")
    empty = np.zeros(0, np.int64)
    for column, kind in _ARRAY_TYPES.items():
        columns[column] = _list_column([row.arrays.get(column, empty) for row in requests], kind)
    return _table(columns)


def cache_event_table(rows: list[SpanRow], attributes: _Attributes) -> pa.Table:
    """``kvtrace_cache_events`` rows: one per ``kvtrace.cache.*`` event of ``rows``."""
    found = [(at, index) for at, row in enumerate(rows) for index, name in enumerate(row[16])
             if name.startswith(sc.CACHE_EVENT_PREFIX)]
    columns = {"Timestamp": arrow([rows[at][15][i] for at, i in found], "t"),
               "TraceId": arrow([rows[at][1] for at, _ in found], "s"),
               "SpanId": arrow([rows[at][2] for at, _ in found], "s")}
    columns.update(attributes.columns(EVENT_SPAN_ATTRIBUTES, np.array([at for at, _ in found], np.int64)))
    columns["event"] = arrow([rows[at][16][i] for at, i in found], "s")
    columns["event_index"] = arrow([i for _, i in found], "u32")
    events = _Attributes([rows[at][17][i] for at, i in found])
    columns.update(events.columns(EVENT_ATTRIBUTES, np.arange(len(found))))
    return _table(columns)


def otel_table(rows: list[SpanRow], attributes: _Attributes) -> pa.Table:
    return _table({name: attributes.map if name == "SpanAttributes" else arrow([row[i] for row in rows], kind)
                   for i, (name, kind) in enumerate(zip(COLUMNS, OTEL_KINDS))})


def store_rows(client, rows: list[SpanRow], token: str) -> None:
    """Write ``rows`` (read typed): typed tables first, then ``otel_traces`` deduplicated by ``token`` (a hash
    of what the rows came from), so a batch written again after a stop stores its spans once."""
    if not rows:
        return
    attributes = _Attributes([row[11] for row in rows])
    tables = {"kvtrace_requests": request_table(rows, attributes),
              "kvtrace_cache_events": cache_event_table(rows, attributes),
              "otel_traces": otel_table(rows, attributes)}
    for name, table in tables.items():
        if table.num_rows:
            # Typed tables fold copies when they merge and queries read FINAL: folding each block on insert as
            # well (the engine's default) costs a third of storing them, for no answer changed.
            settings = ({"insert_deduplication_token": f"{name}:{token}"} if name == "otel_traces" else
                        {"optimize_on_insert": 0})
            client.insert_arrow(name, table, settings=settings)


def batch_token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
