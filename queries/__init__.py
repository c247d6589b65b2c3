"""Saved queries: one statement per ``.sql`` file, loaded and run by name.

Each file starts with a header of ``--`` comment lines::

    -- answers: what question the query answers (first line is the summary)
    -- params: run_a String, run_b String, near_tie Float64 = 0.05
    -- columns: episode_id, turn, position, ...

Parameters appear in the statement as ClickHouse placeholders
(``{run_a:String}``) and are bound by the server — never spliced into SQL.
``${NAME}`` placeholders are ``kvtrace.semconv`` constants (event names,
layer names; a tuple such as ``MARGIN_BIN_EDGES`` as an array literal)
substituted when the file is loaded; ``${shared_NAME}`` inserts
``shared/NAME.sql`` (WITH-clause definitions several queries must agree on,
such as where two outputs diverge), comment lines removed, its own ``${NAME}``
placeholders substituted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from string import Template
from typing import Any, Optional

from kvtrace import semconv
from kvtrace.errors import QueryParameterError, UnknownQuery

_PARAM = re.compile(r"^\s*(?P<name>[a-z_][a-z0-9_]*)\s+(?P<type>[A-Za-z0-9_()]+)\s*(?:=\s*(?P<default>.*))?$")


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: Optional[str] = None

    def convert(self, raw: Any) -> Any:
        """The value to bind; a value the server would reject is refused here, with a message that says why."""
        if not isinstance(raw, str):
            return raw
        try:
            if self.type.startswith(("Int", "UInt")):
                return int(raw)
            if self.type.startswith("Float"):
                value = float(raw)
                if not math.isfinite(value):
                    raise ValueError(raw)
                return value
            if self.type.startswith("DateTime"):
                return _datetime(raw)
        except ValueError:
            raise QueryParameterError(f"parameter {self.name} must be {self.type}{_HINTS.get(self.type[:5], '')}, "
                                      f"got {raw!r}") from None
        return raw


_HINTS = {"Float": " (a finite number)",
          "DateT": " (epoch seconds, or a time such as 2024-05-01 or 2024-05-01T12:00:00, optionally with Z or +02:00)"}
_EPOCH = re.compile(r"^-?\d+(\.\d+)?$")
_YEARS = range(1900, 2300)
"""What ClickHouse's DateTime64 holds."""


def _datetime(raw: str) -> str:
    """A time as ClickHouse parses it: epoch seconds or an ISO 8601 time (one with a zone, as epoch seconds)."""
    text = raw.strip()
    try:
        if _EPOCH.match(text):
            when = datetime.fromtimestamp(float(text), timezone.utc)
        else:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (OverflowError, OSError) as exc:  # beyond any calendar
        raise ValueError(raw) from exc
    if when.year not in _YEARS:
        raise ValueError(raw)
    if _EPOCH.match(text):
        return text
    return f"{when.timestamp():.3f}" if when.tzinfo else when.isoformat(sep=" ")


@dataclass(frozen=True)
class SavedQuery:
    name: str
    summary: str
    params: tuple[Param, ...]
    columns: tuple[str, ...]
    sql: str = field(repr=False)

    def bind(self, values: dict[str, Any]) -> dict[str, Any]:
        known = {p.name: p for p in self.params}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise QueryParameterError(
                f"query {self.name!r} has no parameter {', '.join(unknown)}; "
                f"it takes: {', '.join(known) or 'none'}"
            )
        bound = {}
        for p in self.params:
            if p.name in values:
                bound[p.name] = p.convert(values[p.name])
            elif p.default is not None:
                bound[p.name] = p.convert(_unquote(p.default))
            else:
                raise QueryParameterError(
                    f"query {self.name!r} needs --param {p.name}=VALUE ({p.type})"
                )
        return bound


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1]
    return text


def names() -> list[str]:
    folder = resources.files(__name__)
    return sorted(f.name[:-4] for f in folder.iterdir() if f.name.endswith(".sql"))


def _semconv_arrays() -> dict[str, str]:
    """``semconv`` tuples of names or numbers as ClickHouse array literals (constants, never user input)."""
    arrays = {}
    for key, value in vars(semconv).items():
        if key.isupper() and isinstance(value, tuple) and all(isinstance(v, (str, int, float)) for v in value):
            arrays[key] = "[" + ", ".join(_sql_literal(v) for v in value) + "]"
    return arrays


def _sql_literal(value: str | int | float) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


def _shared_fragments(constants: dict[str, str]) -> dict[str, str]:
    folder = resources.files(__name__) / "shared"
    fragments = {}
    for f in folder.iterdir():
        if f.name.endswith(".sql"):
            text = "\n".join(line for line in f.read_text().splitlines() if not line.lstrip().startswith("--"))
            fragments[f"shared_{f.name[:-4]}"] = Template(text.strip()).substitute(constants)
    return fragments


def load(name: str) -> SavedQuery:
    if not re.fullmatch(r"[a-z0-9_]+", name or "") or name not in names():
        raise UnknownQuery(f"no saved query named {name!r}; available: {', '.join(names())}")
    text = (resources.files(__name__) / f"{name}.sql").read_text()
    header: dict[str, list[str]] = {}
    current = None
    body_lines = []
    in_header = True
    for line in text.splitlines():
        stripped = line.strip()
        if in_header and stripped.startswith("--"):
            content = stripped[2:].strip()
            m = re.match(r"^(answers|params|columns):\s*(.*)$", content)
            if m:
                current = m.group(1)
                header.setdefault(current, []).append(m.group(2))
            elif current and content:
                header[current].append(content)
            continue
        in_header = False
        body_lines.append(line)

    constants = {**semconv.names(), **_semconv_arrays()}
    sql = Template("\n".join(body_lines)).substitute({**constants, **_shared_fragments(constants)})
    sql = sql.strip().rstrip(";")
    params = []
    for chunk in ",".join(header.get("params", [])).split(","):
        if chunk.strip() and chunk.strip() != "none":
            m = _PARAM.match(chunk)
            if not m:
                raise ValueError(f"{name}.sql: cannot read parameter declaration {chunk!r}")
            params.append(Param(m["name"], m["type"], m["default"]))
    columns = tuple(c.strip() for c in ",".join(header.get("columns", [])).split(",") if c.strip())
    return SavedQuery(name, " ".join(header.get("answers", [""])), tuple(params), columns, sql)


ANALYSIS_SETTINGS = {
    "optimize_and_compare_chain": 0,
    "optimize_aggregators_of_group_by_keys": 0,
    "optimize_group_by_function_keys": 0,
    "optimize_redundant_functions_in_order_by": 0,
}
"""Query-tree rewrites that find nothing to fold in these queries but took a third or more of their analysis
(docs/ARCHITECTURE.md, "A new question"); turning them off never changes a result."""


CLUSTER_SETTINGS = {"distributed_product_mode": "global"}
"""On a cluster (docs/storage.md): a subquery inside a read of a Distributed table runs once, on the node the
query came to, over every shard, and its rows go to the shards (ClickHouse's default refuses every saved query
there); on one node it changes nothing."""


def run(client, name: str, values: Optional[dict[str, Any]] = None):
    """Run saved query ``name`` with bound parameters; returns (column names, rows)."""
    query = load(name)
    wanted = {**ANALYSIS_SETTINGS, **CLUSTER_SETTINGS}
    known = getattr(client, "server_settings", None) or wanted  # a server too old for one: left out
    settings = {setting: value for setting, value in wanted.items() if setting in known}
    result = client.query(query.sql, parameters=query.bind(values or {}), settings=settings)
    return list(result.column_names), result.result_rows
