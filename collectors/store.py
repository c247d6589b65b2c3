"""Rows of spans (``otlp_rows``, read typed) → kvtrace's tables and ``otel_traces``, as Arrow columns.

The one write path of ingest and of the ClickHouse exporter. Each typed table's columns are those its
declaration in ``tables.py`` lists, computed as the table's view computes them from a Collector's rows
(``conversions.py``; ``tests/test_typed_ingest.py`` holds the two paths to the same rows):
``kvtrace_requests`` one row per request span, its per-token arrays as Array columns (the rows'
packed bytes joined and viewed once, no Python work per number; a negative zero stored as 0, as the Collector's
text "-0" reads back); ``kvtrace_cache_events`` one row per ``kvtrace.cache.*`` event. Every table is
built before the first insert, so a value Arrow cannot carry stops the batch before anything of it is
written.
"""

from __future__ import annotations

import hashlib
from itertools import chain
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.collectors import tables
from kvtrace.collectors.conversions import TEXT
from kvtrace.collectors.otlp_rows import COLUMNS, SpanRow
from kvtrace.collectors.tables import ATTRIBUTE, EVENT, EVENT_ATTRIBUTE, MATERIALIZED, SPAN, TOKEN_ARRAY, Column, Table

_KINDS = {"DateTime64(9)": "t", "String": "s", "Int32": "i32", "UInt32": "u32", "UInt64": "u64", "Int64": "i64",
          "Float64": "f64"}
"""A typed column's ``value_type`` → the ``arrow`` kind it is built as (an ``Array(T)``: see ``kind_of``)."""
_OTEL_KINDS = {"Timestamp": "t", "ResourceAttributes": "map", "SpanAttributes": "map", "Duration": "u64",
               "Events_Timestamp": ("list", "t"), "Events_Attributes": ("list", "map"),
               "Links_Attributes": ("list", "map")}
"""``SpanRow``'s fields other than text, and lists of text (its other ``Events_`` and ``Links_`` fields)."""
_EVENT_VALUES = {"time": lambda row, i: row.Events_Timestamp[i], "name": lambda row, i: row.Events_Name[i],
                 "index": lambda row, i: i}
"""``tables.EVENT_FIELDS``: an event's own fields, of its span's row."""
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


def _list_column(arrays: list, kind: str) -> pa.Array:
    """One Array column from per-row arrays (packed little-endian bytes as the spool holds them, or numpy):
    one join and one view, no per-number work."""
    dtype = np.dtype(_NUMERIC[kind][0])
    packed = [a if type(a) is bytes else np.asarray(a, dtype.newbyteorder("<")).tobytes() for a in arrays]
    values = np.frombuffer(b"".join(packed), dtype.newbyteorder("<")).astype(dtype, copy=False)
    if kind == "f64":
        values = values + 0.0  # -0.0 + 0.0 is 0.0: a negative zero is stored as 0
    return pa.ListArray.from_arrays(_offsets([len(a) >> 3 for a in packed]), _buffer(values, kind))


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

    def columns(self, columns: list[Column], rows: np.ndarray) -> dict[str, pa.Array]:
        """``columns`` (each from the attribute its ``source`` names) of ``rows`` (indices of the maps), a
        missing key's text read as ""."""
        sources = {source: i for i, source in enumerate(dict.fromkeys(column.source for column in columns))}
        code_of = np.array([sources.get(key, -1) for key in self._key_names], np.int64)
        codes = code_of[self._key_codes] if len(code_of) else np.zeros(0, np.int64)
        where = np.full((len(sources), self._rows), len(self._texts) - 1, np.int64)
        entries = np.flatnonzero(codes >= 0)
        where[codes[entries], self._row_of[entries]] = entries  # a map holds a key once
        texts = self._texts.take(_buffer(where[:, rows].ravel(), "i64"))  # one gather for every column
        n = len(rows)
        return {column.name: _typed(texts.slice(sources[column.source] * n, n), column) for column in columns}


def _typed(texts: pa.Array, column: Column) -> pa.Array:
    how, kind = column.conversion, kind_of(column.value_type)
    if how is TEXT:
        return texts
    if how.bounds:
        integers = _plain_integers(texts, *how.bounds)
        if integers is not None:
            return _buffer(integers.astype(_NUMERIC[kind][0]), kind)
    return arrow([how.convert(text) for text in texts.to_pylist()], kind)


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


def kind_of(value_type: str):
    """The ``arrow`` kind of a ClickHouse type (``Array(T)``: a list of T's kind)."""
    inner = value_type[len("Array("):-1] if value_type.startswith("Array(") else None
    return ("list", kind_of(inner)) if inner else _KINDS[value_type]


def typed_table(table: Table, rows: list[SpanRow], attributes: Optional[_Attributes] = None) -> pa.Table:
    """``table``'s rows from ``rows`` (``attributes``: their maps, when made already): one per span named
    ``table.span_name`` that was read typed, or one per event whose name starts with ``table.event_prefix``."""
    attributes = attributes or _Attributes([row.SpanAttributes for row in rows])
    if table.event_prefix:
        found = [(at, i) for at, row in enumerate(rows) for i, name in enumerate(row.Events_Name)
                 if name.startswith(table.event_prefix)]
    else:
        found = [(at, 0) for at, row in enumerate(rows) if row.SpanName == table.span_name and row.arrays is not None]
    spans = [rows[at] for at, _ in found]
    typed = attributes.columns([c for c in table.columns if c.origin == ATTRIBUTE],
                               np.array([at for at, _ in found], np.int64))
    if table.event_prefix:
        events = _Attributes([rows[at].Events_Attributes[i] for at, i in found])
        typed.update(events.columns([c for c in table.columns if c.origin == EVENT_ATTRIBUTE], np.arange(len(found))))
    columns = {}
    for column in table.columns:
        if column.origin == SPAN:
            columns[column.name] = arrow([getattr(row, column.source) for row in spans], kind_of(column.value_type))
        elif column.origin == EVENT:
            value = _EVENT_VALUES[column.source]
            columns[column.name] = arrow([value(rows[at], i) for at, i in found], kind_of(column.value_type))
        elif column.origin == TOKEN_ARRAY:
            columns[column.name] = _list_column([row.arrays.get(column.name, b"") for row in spans],
                                                kind_of(column.value_type)[1])
        elif column.origin != MATERIALIZED:
            columns[column.name] = typed[column.name]
    return _table(columns)


def otel_table(rows: list[SpanRow], attributes: _Attributes) -> pa.Table:
    return _table({column: attributes.map if field == "SpanAttributes" else arrow(values, _otel_kind(field))
                   for column, field, values in zip(COLUMNS, SpanRow._fields, zip(*rows))})


def _otel_kind(field: str):
    return _OTEL_KINDS.get(field, ("list", "s") if "_" in field else "s")


def store_rows(client, rows: list[SpanRow], token: str) -> None:
    """Write ``rows`` (read typed): typed tables first, then ``otel_traces`` deduplicated by ``token`` (a hash
    of what the rows came from), so a batch written again after a stop stores its spans once."""
    if not rows:
        return
    attributes = _Attributes([row.SpanAttributes for row in rows])
    built = {table.name: typed_table(table, rows, attributes) for table in tables.TYPED_TABLES}
    built["otel_traces"] = otel_table(rows, attributes)
    for name, table in built.items():
        if table.num_rows:
            # Typed tables fold copies when they merge and queries read FINAL: folding each block on insert as
            # well (the engine's default) costs a third of storing them, for no answer changed.
            settings = ({"insert_deduplication_token": f"{name}:{token}"} if name == "otel_traces" else
                        {"optimize_on_insert": 0})
            client.insert_arrow(name, table, settings=settings)


def store_spans_lost_to_a_kill(client, rows: list[SpanRow], token: str) -> None:
    """After ``store_rows(client, rows, token)``: write again the rows ``otel_traces`` lacks, under a token of
    their own. A non-replicated MergeTree records a block's token before it moves the block's
    part into place, so a process killed between the two leaves the token without the rows, and the same
    chunk stored again under it is dropped as a copy. An insert dropped against a live one returns only
    once that one's part is in place, so rows missing here are rows no process will write."""
    spans = {(row.TraceId, row.SpanId) for row in rows}
    present = client.query(_PRESENT_SQL, parameters={"traces": sorted({trace for trace, _ in spans})}).result_rows
    missing = spans - {tuple(pair) for pair in present}
    if missing:
        lost = [row for row in rows if (row.TraceId, row.SpanId) in missing]
        again = batch_token("".join(sorted(span for _, span in missing)).encode())
        client.insert_arrow("otel_traces", otel_table(lost, _Attributes([row.SpanAttributes for row in lost])),
                            settings={"insert_deduplication_token": f"otel_traces:{token}:lost:{again}"})


_PRESENT_SQL = "SELECT DISTINCT TraceId, SpanId FROM otel_traces WHERE TraceId IN {traces:Array(String)}"


def batch_token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
