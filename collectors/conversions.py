"""An attribute's text → a typed column's value, in ClickHouse's SQL (the views) and in Python (the writer).

The Collector's ClickHouse exporter stores every attribute as text; a view converts it with ClickHouse's
functions (``toUInt32OrZero``, ``JSONExtract`` …). Ingest reads the same text and must store the same value,
so each conversion is written here twice, side by side: its SQL and its Python twin.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Callable, NamedTuple, Optional

import msgspec

# ASCII digits only, as ClickHouse reads them ("٣" and "１２" are its default, not 3 and 12).
_SIGNED, _UNSIGNED = re.compile(r"[+-]?[0-9]+"), re.compile(r"\+?[0-9]+")
_STRINGS = msgspec.json.Decoder(list[str]).decode
_INTEGERS = msgspec.json.Decoder(list[int]).decode


class Conversion(NamedTuple):
    """Text → a column's type: ``sql`` (``{}`` the text's expression) and ``convert``, its Python twin."""

    sql: str
    convert: Callable[[str], object]
    bounds: Optional[tuple[int, int, int]] = None
    """An integer's (lowest, highest, default): a column of plain digits is converted in Arrow."""


def _integer(sql: str, pattern: re.Pattern, low: int, high: int, default: int) -> Conversion:
    def convert(text: str) -> int:
        value = int(text) if (text.isascii() and text.isdigit()) or pattern.fullmatch(text) else default
        return value if low <= value <= high else default
    return Conversion(sql, convert, (low, high, default))


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


TEXT = Conversion("{}", str)
BY_TYPE = {
    "String": TEXT,
    "Int32": _integer("toInt32OrDefault({}, toInt32(-1))", _SIGNED, -2**31, 2**31 - 1, -1),
    "UInt32": _integer("toUInt32OrZero({})", _UNSIGNED, 0, 2**32 - 1, 0),
    "UInt64": _integer("toUInt64OrZero({})", _UNSIGNED, 0, 2**64 - 1, 0),
    "Array(String)": Conversion("JSONExtract({}, 'Array(String)')", _json_array(str)),
    "Array(Int64)": Conversion("JSONExtract({}, 'Array(Int64)')", _json_array(int)),
}
"""An attribute's conversion by the column's type (``LowCardinality`` left out: it stores the same values)."""


def or_instead(empty: str) -> Conversion:
    """Text, ``empty`` where there is none (an absent attribute reads as "")."""
    return Conversion(f"if({{0}} = '', {sql_string(empty)}, {{0}})", lambda text: text or empty)


def sql_string(text: str) -> str:
    """``text`` as an SQL string literal in a template (``$`` doubled: the schema substitutes ``${name}``)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("$", "$$") + "'"


NUMBER_ARRAY_SQL = {
    "Array(Int64)": "JSONExtract({}, 'Array(Int64)')",
    # A negative zero is stored as 0 whichever text a writer gave it ("-0", "-0.0"), as ingest stores it.
    "Array(Float64)": "arrayMap(x -> x + 0., JSONExtract({}, 'Array(Float64)'))",
}
"""A per-token array's text (the Collector's JSON) → its column; ingest reads the numbers themselves."""
