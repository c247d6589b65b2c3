"""Completing the materialized views after an INSERT that died halfway.

ClickHouse writes an INSERT's block to ``otel_traces`` first and then to each
materialized view's target table, each as a part of its own.  A process
killed in between leaves spans in ``otel_traces`` that ``kvtrace_requests``,
``kvtrace_tokens`` or ``kvtrace_cache_events`` lack, and inserting the spans
again would store them twice.  Ingest notices such spans when it checks which
spans of a chunk are stored already; ``complete_views`` then writes just the
missing view rows, by running each view's own SELECT over those spans.

Views are read from ``system.tables`` (the definitions in ``collectors/sql``
as the database holds them), following the chain from ``otel_traces``:
views whose output has no ``SpanId`` (the trace-id time index) are left as
they are.  A view row counts as present when its target holds any row of the
span, since one span's rows of one view arrive in one block, which ClickHouse
writes whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SOURCE = "otel_traces"
_SPANS_IN = "SpanId IN (SELECT arrayJoin({span_ids:Array(String)}))"
_TARGET = re.compile(r"\bTO\s+(?:`?[\w]+`?\.)?`?(\w+)`?", re.IGNORECASE)

TABLES_SQL = ("SELECT name, engine, dependencies_table, create_table_query, as_select "
              "FROM system.tables WHERE database = currentDatabase()")
COLUMNS_SQL = "SELECT name FROM system.columns WHERE database = currentDatabase() AND table = {table:String}"


@dataclass(frozen=True)
class View:
    name: str
    target: str
    select: str
    columns: tuple[str, ...]


def views_from(client, source: str = SOURCE) -> list[View]:
    """Materialized views fed by ``source``, directly or through other views, sources first."""
    tables = {name: (engine, list(dependents), create, select)
              for name, engine, dependents, create, select in client.query(TABLES_SQL).result_rows}
    ordered: list[View] = []
    queue, seen = [source], set()
    while queue:
        table = queue.pop(0)
        for name in tables.get(table, ("", [], "", ""))[1]:
            if name in seen or name not in tables:
                continue
            seen.add(name)
            engine, _, create, select = tables[name]
            match = _TARGET.search(create or "")
            if engine != "MaterializedView" or not match or not select:
                continue
            columns = tuple(row[0] for row in client.query(COLUMNS_SQL, parameters={"table": name}).result_rows)
            if "SpanId" in columns:
                ordered.append(View(name, match.group(1), select, columns))
            queue.append(match.group(1))
    return ordered


def complete_views(client, span_ids: list[str]) -> int:
    """Write the view rows that spans ``span_ids`` (all in ``otel_traces``) should have but lack.

    Returns how many spans needed rows in some view.  A view filled here feeds the views chained
    on it (as any insert does), so those are checked after it and find their rows present.
    """
    if not span_ids:
        return 0
    completed = 0
    for view in views_from(client):
        parameters = {"span_ids": sorted(set(span_ids))}
        expected = {row[0] for row in client.query(
            f"SELECT DISTINCT SpanId FROM ({view.select}) WHERE {_SPANS_IN}",
            parameters=parameters).result_rows}
        if not expected:
            continue
        present = {row[0] for row in client.query(
            f"SELECT DISTINCT SpanId FROM `{view.target}` WHERE {_SPANS_IN}",
            parameters=parameters).result_rows}
        missing = sorted(expected - present)
        if not missing:
            continue
        columns = ", ".join(f"`{c}`" for c in view.columns)
        client.command(
            f"INSERT INTO `{view.target}` ({columns}) SELECT {columns} FROM ({view.select}) WHERE {_SPANS_IN}",
            parameters={"span_ids": missing})
        completed += len(missing)
    return completed
