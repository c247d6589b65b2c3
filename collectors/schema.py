"""The ClickHouse schema: render the DDL in ``collectors/sql`` and apply it.

Templates use ``${name}`` placeholders: the database, the table names, the
engine and ``ON CLUSTER`` clause, and every ``kvtrace.semconv`` constant (so
the views read exactly the attribute names the recorder writes).  Only
identifiers validated here are substituted — never user data.

Single node (chDB or one server): MergeTree tables.  ``cluster=NAME``: every
object ``ON CLUSTER NAME``, tables as ``<name>_local`` with Replicated engines,
and a Distributed table under the plain name in front of each, so queries and
inserts address the same names either way (the materialized views hang off
the local tables, so each shard explodes what it stores).
"""

from __future__ import annotations

import re
from importlib import resources
from string import Template

from kvtrace import semconv

TABLES = ("otel_traces", "otel_traces_trace_id_ts", "kvtrace_requests", "kvtrace_tokens",
          "kvtrace_cache_events", "kvtrace_ingest_files")
VIEWS = ("otel_traces_trace_id_ts_mv", "kvtrace_requests_mv", "kvtrace_tokens_mv", "kvtrace_cache_events_mv")
# Tables that get a Distributed table in front of them in cluster mode.
DISTRIBUTED = ("otel_traces", "otel_traces_trace_id_ts", "kvtrace_requests", "kvtrace_tokens", "kvtrace_cache_events")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _ident(name: str, what: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"{what} {name!r} is not a plain identifier (letters, digits, underscore)")
    return name


def semconv_names() -> dict[str, str]:
    return {k: v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}


def _templates() -> list[tuple[str, str]]:
    folder = resources.files("kvtrace.collectors") / "sql"
    return sorted((f.name, f.read_text()) for f in folder.iterdir() if re.match(r"^\d\d_.*\.sql$", f.name))


def render_ddl(database: str = "default", cluster: str | None = None) -> list[str]:
    """The statements ``kvtrace db init`` runs, in order."""
    _ident(database, "database name")
    names = semconv_names()
    variables: dict[str, str] = {**names, "database": f"`{database}`"}
    if cluster:
        _ident(cluster, "cluster name")
        variables["on_cluster"] = f"ON CLUSTER `{cluster}`"
        variables["engine"] = "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')"
        variables["replacing_engine"] = (
            "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', updated)"
        )
        for table in TABLES:
            variables[table] = f"`{table}_local`" if table in DISTRIBUTED else f"`{table}`"
    else:
        variables["on_cluster"] = ""
        variables["engine"] = "MergeTree()"
        variables["replacing_engine"] = "ReplacingMergeTree(updated)"
        for table in TABLES:
            variables[table] = f"`{table}`"
    for view in VIEWS:
        variables[view] = f"`{view}`"
    statements = []
    distributed_template = None
    for name, text in _templates():
        if name.startswith("90_distributed"):
            distributed_template = text
            continue
        statements.append(_strip_comments(Template(text).substitute(variables)))
    if cluster and distributed_template:
        for table in DISTRIBUTED:
            statements.append(_strip_comments(Template(distributed_template).substitute(
                variables,
                table=f"`{table}`",
                local_table=f"`{table}_local`",
                cluster_literal=f"'{cluster}'",
                database_literal=f"'{database}'",
                local_table_literal=f"'{table}_local'",
            )))
    return statements


def _strip_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--")).strip()


def init_schema(client, database: str | None = None, cluster: str | None = None) -> list[str]:
    """Create every kvtrace object (idempotent).  Returns the statements run."""
    database = database or client.database or "default"
    if database != "default":
        on_cluster = f" ON CLUSTER `{_ident(cluster, 'cluster name')}`" if cluster else ""
        client.command(f"CREATE DATABASE IF NOT EXISTS `{_ident(database, 'database name')}`{on_cluster}")
    statements = render_ddl(database, cluster)
    for statement in statements:
        client.command(statement)
    return statements


def missing_tables(client, database: str | None = None) -> list[str]:
    database = database or client.database or "default"
    present = {row[0] for row in client.query(
        "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": database}).result_rows}
    return [t for t in TABLES if t not in present]
