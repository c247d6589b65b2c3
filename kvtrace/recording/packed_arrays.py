"""kvtrace's per-token arrays in the spool: packed little-endian numbers in an OTLP ``bytesValue``.

A request span carries arrays with one element per generated token (and, with ``ids``
capture, the prompt's token ids).  As standard OTLP/JSON each element is a value object of its
own (``{"doubleValue":0.123…}``, ~35 bytes and a dict to build and to parse); in the spool each
array is instead one ``bytesValue``: the elements as little-endian int64 or float64, base64 as
OTLP/JSON writes bytes.  That is 8 bytes per element before base64, packed in one C call and
unpacked in one, and bit-exact for every double (NaN payloads included).

The line stays a valid OTLP ``ExportTraceServiceRequest``; only the meaning of these attributes'
bytes is kvtrace's: ``kvtrace db ingest`` checks them and views them as numpy arrays, which go to
``kvtrace_requests`` as typed Array columns without a Python step per number (those its declaration in
``collectors/tables.py`` lists).  Spans sent to a
Collector over OTLP keep standard arrays (see ``otlp_json.encode_request``).
"""

from __future__ import annotations

import sys
from array import array
from typing import Optional, Sequence

from kvtrace import semconv as sc

INT64 = "q"
FLOAT64 = "d"

PACKED_ARRAYS: dict[str, str] = {
    sc.OUTPUT_TOKEN_IDS: INT64,
    sc.OUTPUT_TOP1_IDS: INT64,
    sc.OUTPUT_RUNNER_UP_IDS: INT64,
    sc.OUTPUT_MARGINS: FLOAT64,
    sc.OUTPUT_LOGPROBS: FLOAT64,
    sc.PROMPT_TOKEN_IDS: INT64,
    sc.OUTPUT_STEP_ROWS: INT64,
    sc.OUTPUT_STEP_TOKENS: INT64,
    sc.PROMPT_PREFILL_STEPS: INT64,
}
"""Attribute key → element type of every array the spool packs."""

_BIG_ENDIAN = sys.byteorder == "big"


def pack(values: Sequence, typecode: str) -> Optional[bytes]:
    """``values`` as little-endian int64 / float64 bytes; ``None`` when they do not all fit the type."""
    if isinstance(values, array) and values.typecode == typecode and not _BIG_ENDIAN:
        return values.tobytes()  # already packed (hashed token ids): one copy, no element touched
    try:
        packed = array(typecode, values)
    except (TypeError, OverflowError, ValueError):
        return None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes, typecode: str) -> array:
    """The elements packed in ``data``; ``ValueError`` when its length is not a whole number of them."""
    values = array(typecode)
    values.frombytes(data)  # raises ValueError for a length that is not a multiple of 8
    if _BIG_ENDIAN:
        values.byteswap()
    return values
