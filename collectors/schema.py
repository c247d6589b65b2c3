"""The ClickHouse schema: render it, create it, bring an older database to it (docs/ARCHITECTURE.md,
"Schema versions").

The current schema is ``collectors/sql``'s templates with each typed table's DDL and view, rendered from
``tables.py``, in their place among the files. Placeholders ``${name}``: the database, table names, engine
and ``ON CLUSTER`` clause, and every ``kvtrace.semconv`` constant; only identifiers validated here are
substituted, never user data. ``cluster=NAME``: every object ``ON CLUSTER NAME``, tables as
``<name>_local`` with Replicated engines behind a Distributed table of the plain name (the views hang off
the local tables, so each shard explodes what it stores).

``init_schema`` runs the numbered ``collectors/migrations`` a database has not recorded, then the current
DDL (objects new since), points every materialized view at its current SELECT (``MODIFY QUERY``: no stored
row touched) and records the versions last. Every statement may run twice (``IF NOT EXISTS``), so an
interrupted upgrade is run again, and two processes upgrading one server run the same statements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from string import Template

from kvtrace import semconv
from kvtrace.collectors import tables as typed_tables
from kvtrace.errors import SchemaUpgradeFailed

SPAN_TABLES = tuple(table.name for table in typed_tables.TYPED_TABLES)
"""kvtrace's typed tables: one row per span (and event), copies folded by the engine."""
TABLES = ("otel_traces", "otel_traces_trace_id_ts", *SPAN_TABLES, "kvtrace_tokens", "kvtrace_ingest_files",
          "kvtrace_ingest_lines")
"""Every name a query may read (``kvtrace_tokens`` is a view of ``kvtrace_requests``)."""
VERSIONS_TABLE = "kvtrace_schema_migrations"
VIEWS = ("otel_traces_trace_id_ts_mv", *(f"{table}_mv" for table in SPAN_TABLES))
REBUILT_IN_0005 = ("kvtrace_requests", "kvtrace_tokens", "kvtrace_cache_events")
"""The typed tables of version 5, which migration 0005 rebuilds (the tokens table until 0006 drops it)."""
# Tables that get a Distributed table in front of them in cluster mode.
DISTRIBUTED = ("otel_traces", "otel_traces_trace_id_ts", *SPAN_TABLES)
SHARDING_KEYS = {"otel_traces": "cityHash64(TraceId)", "otel_traces_trace_id_ts": "cityHash64(TraceId)",
                 **{table: "cityHash64(run_id)" for table in SPAN_TABLES}}
"""Each Distributed table's sharding key: copies of a span land on one shard, where they fold, and a run's
rows on one shard (a query over two runs reads at most two)."""
# The table whose presence says a database has a kvtrace schema at all.
_MARKER_TABLE = "kvtrace_requests"

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_VIEW_SELECT = re.compile(r"^CREATE MATERIALIZED VIEW IF NOT EXISTS (\S+) .*?^AS (SELECT\b.*)$", re.S | re.M)


@dataclass(frozen=True)
class Migration:
    """One numbered file of ``collectors/migrations``: the statements that bring version - 1 to version."""

    version: int
    name: str
    template: str = field(repr=False)

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


@dataclass(frozen=True)
class SchemaChange:
    """What ``init_schema`` did: the version before (0: no kvtrace schema) and after, migrations run."""

    version_before: int
    version: int
    applied: tuple[str, ...]


def _ident(name: str, what: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"{what} {name!r} is not a plain identifier (letters, digits, underscore)")
    return name


def _templates() -> list[tuple[str, str]]:
    """Every template by its file name, in order: ``collectors/sql``'s and the typed tables' rendered ones."""
    folder = resources.files("kvtrace.collectors") / "sql"
    files = [(f.name, f.read_text()) for f in folder.iterdir() if re.match(r"^\d\d_.*\.sql$", f.name)]
    return sorted(files + typed_tables.rendered(typed_tables.TYPED_TABLES))


def migrations() -> list[Migration]:
    """Every migration, oldest first (version 1 is the first release's schema)."""
    folder = resources.files("kvtrace.collectors") / "migrations"
    found = sorted((Migration(int(m[1]), m[2], f.read_text())
                    for f in folder.iterdir() if (m := _MIGRATION_FILE.match(f.name))), key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError("collectors/migrations must hold 0001_*.sql, 0002_*.sql, … without gaps or repeats")
    return found


def latest_version() -> int:
    return migrations()[-1].version


def _variables(database: str, cluster: str | None) -> dict[str, str]:
    _ident(database, "database name")
    variables: dict[str, str] = {**semconv.names(), "database": f"`{database}`"}
    if cluster:
        _ident(cluster, "cluster name")
        variables["on_cluster"] = f"ON CLUSTER `{cluster}`"
        variables["engine"] = "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')"
        variables["replacing_engine"] = (
            "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', updated)"
        )
        # Keeper path by the table's UUID, not its name: a rebuilt table is created under another name and
        # exchanged (migration 0005), and a rebuild run again must not meet the path of the one before.
        variables["span_engine"] = "ReplicatedReplacingMergeTree('/clickhouse/tables/{uuid}/{shard}', '{replica}')"
        # The schema version belongs to the whole cluster: one replica set across all shards.
        variables["versions_engine"] = (
            "ReplicatedMergeTree('/clickhouse/tables/all_shards/{database}/{table}', '{shard}-{replica}')"
        )
    else:
        variables["on_cluster"] = ""
        variables["engine"] = "MergeTree()"
        variables["replacing_engine"] = "ReplacingMergeTree(updated)"
        # kvtrace's typed tables: copies of a span's rows (a retried write, two paths) fold into one.
        variables["span_engine"] = "ReplacingMergeTree()"
        variables["versions_engine"] = "MergeTree()"
    for table in TABLES + (VERSIONS_TABLE,):  # kvtrace_tokens: the table of versions 1-5, local on a cluster
        local = cluster and (table in DISTRIBUTED or table == "kvtrace_tokens")
        variables[table] = f"`{table}_local`" if local else f"`{table}`"
    for view in VIEWS:
        variables[view] = f"`{view}`"
    variables["kvtrace_tokens_view"] = "`kvtrace_tokens`"
    variables.update(_rebuild_variables(database, cluster))
    return variables


def _rebuild_variables(database: str, cluster: str | None) -> dict[str, str]:
    """For a migration that rebuilds a typed table: ``${T_rebuilt}``, the new table built beside ``T``, and
    ``${T_rebuilt_copy}``, what the copy of ``T``'s rows is inserted into (on a cluster, every shard's local
    table through the cluster table function: an INSERT runs on one node only; a run's rows go to one shard,
    so copies of a span stored on two shards meet and fold)."""
    variables = {}
    for table in REBUILT_IN_0005:
        rebuilt = f"{table}_rebuilt"
        if cluster:
            variables[rebuilt] = f"`{rebuilt}_local`"
            variables[f"{rebuilt}_copy"] = (
                f"FUNCTION cluster('{cluster}', '{database}', '{rebuilt}_local', cityHash64(run_id))")
        else:
            variables[rebuilt] = f"`{rebuilt}`"
            variables[f"{rebuilt}_copy"] = f"`{database}`.`{rebuilt}`"
    return variables


def split_statements(sql: str) -> list[str]:
    """The statements of a rendered file: comment lines dropped, split at a ``;`` that ends a line."""
    text = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in re.split(r";[ \t]*(?:\n|$)", text) if s.strip()]


def render_ddl(database: str = "default", cluster: str | None = None) -> list[str]:
    """The statements that create the current schema (``kvtrace db init --print``), in order: on a cluster
    the Distributed tables where ``90_distributed.sql`` stands, before the views that read them."""
    variables = _variables(database, cluster)
    statements = []
    for name, text in _templates():
        if not name.startswith("90_distributed"):
            statements.extend(split_statements(Template(text).substitute(variables)))
            continue
        for table in DISTRIBUTED if cluster else ():
            statements.extend(split_statements(Template(text).substitute(
                variables,
                table=f"`{table}`",
                local_table=f"`{table}_local`",
                cluster_literal=f"'{cluster}'",
                database_literal=f"'{database}'",
                local_table_literal=f"'{table}_local'",
                sharding_key=SHARDING_KEYS[table],
            )))
    return statements


def render_migration(migration: Migration, database: str = "default", cluster: str | None = None) -> list[str]:
    return split_statements(Template(migration.template).substitute(_variables(database, cluster)))


def render_view_queries(database: str = "default", cluster: str | None = None) -> list[str]:
    """``ALTER TABLE view MODIFY QUERY`` for every materialized view: its SELECT as the current DDL has it."""
    on_cluster = _variables(database, cluster)["on_cluster"]
    updates = []
    for statement in render_ddl(database, cluster):
        match = _VIEW_SELECT.match(statement)
        if match:
            updates.append(f"ALTER TABLE {match[1]} {on_cluster} MODIFY QUERY {match[2]}")
    return updates


def _inspect(client, database: str) -> tuple[set[str], set[int]]:
    """The database's table names and the schema versions it has recorded."""
    tables = {row[0] for row in client.query(
        "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": database}).result_rows}
    if VERSIONS_TABLE not in tables:
        return tables, set()
    return tables, {int(row[0]) for row in client.query(
        "SELECT DISTINCT version FROM {db:Identifier}.{table:Identifier}",
        parameters={"db": database, "table": VERSIONS_TABLE}).result_rows}


def _version(tables: set[str], recorded: set[int]) -> int:
    if recorded:
        return max(recorded)
    return 1 if _MARKER_TABLE in tables else 0


def schema_version(client, database: str | None = None) -> int:
    """The database's schema version: 0 when it has no kvtrace schema, 1 when it predates recorded versions."""
    return _version(*_inspect(client, database or client.database or "default"))


def schema_state(client, database: str | None = None) -> tuple[int, list[str]]:
    """The schema version and the kvtrace tables missing (what opening a database checks, in two queries)."""
    tables, recorded = _inspect(client, database or client.database or "default")
    return _version(tables, recorded), [t for t in TABLES if t not in tables]


def cluster_of(client, database: str) -> str | None:
    """The cluster a schema was created on (the one its Distributed ``kvtrace_requests`` names), if any."""
    rows = client.query(
        "SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = {table:String} "
        "AND engine = 'Distributed'", parameters={"db": database, "table": _MARKER_TABLE}).result_rows
    match = re.match(r"^Distributed\('([^']+)'", rows[0][0]) if rows else None
    return match[1] if match else None


def init_schema(client, database: str | None = None, cluster: str | None = None) -> SchemaChange:
    """Create the kvtrace schema, or bring an existing one to the latest version (idempotent)."""
    database = _ident(database or client.database or "default", "database name")
    cluster = cluster or cluster_of(client, database)
    tables, recorded = _inspect(client, database)
    before = _version(tables, recorded)
    everything = migrations()
    if not before:
        to_apply = []  # a new database: the current DDL is the latest schema
    elif recorded:
        to_apply = [m for m in everything if m.version not in recorded]
    else:
        to_apply = [m for m in everything if m.version > 1]  # the first release recorded no version

    def execute(step: str, statements: list[str]) -> None:
        for statement in statements:
            try:
                client.command(statement)
            except Exception as exc:
                raise SchemaUpgradeFailed(
                    f"cannot bring database {database!r} from schema version {before} to {everything[-1].version}: "
                    f"{step} failed: {first_line(exc)}. Nothing is recorded as applied; fix the cause and run "
                    "`kvtrace db init` again."
                ) from None

    if database != "default":
        on_cluster = f" ON CLUSTER `{_ident(cluster, 'cluster name')}`" if cluster else ""
        execute("creating the database", [f"CREATE DATABASE IF NOT EXISTS `{database}`{on_cluster}"])
    for migration in to_apply:
        execute(f"migration {migration.label}", render_migration(migration, database, cluster))
    execute("creating the current schema", render_ddl(database, cluster))
    if to_apply:
        execute("pointing the views at their current SELECT", render_view_queries(database, cluster))
        if cluster:
            execute("adding the new columns to the Distributed tables",
                    distributed_column_additions(client, database, cluster))
    if cluster:  # Distributed tables made before their sharding key was the run's or trace's get it now
        engines = dict(client.query(
            "SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND engine = 'Distributed'",
            parameters={"db": database}).result_rows)
        execute("sharding the Distributed tables by run and trace", sharding_updates(engines, database, cluster))
    unrecorded = [[m.version, m.name] for m in everything if m.version not in recorded]
    if unrecorded:
        try:
            client.insert(VERSIONS_TABLE, unrecorded, column_names=["version", "name"], database=database)
        except Exception as exc:
            raise SchemaUpgradeFailed(f"database {database!r} has the schema of version {everything[-1].version} "
                                      f"but recording it failed: {first_line(exc)}") from None
    return SchemaChange(before, everything[-1].version, tuple(m.label for m in to_apply))


def distributed_column_additions(client, database: str, cluster: str) -> list[str]:
    """``ADD COLUMN`` for each column a local table has and its Distributed table in front lacks (a MATERIALIZED
    one with its expression: the Distributed table computes it on insert, as the local table would)."""
    columns: dict[str, list[tuple[str, str]]] = {}
    for table, name, type_, kind, expression in client.query(
            "SELECT table, name, type, default_kind, default_expression FROM system.columns "
            "WHERE database = {db:String} ORDER BY table, position", parameters={"db": database}).result_rows:
        columns.setdefault(table, []).append((name, f"{type_} {kind} {expression}" if kind else type_))
    additions = []
    for table in DISTRIBUTED:
        present = {name for name, _ in columns.get(table, [])}
        local = columns.get(f"{table}_local", [])
        for index, (name, definition) in enumerate(local):
            if name not in present:
                after = f" AFTER `{local[index - 1][0]}`" if index else " FIRST"
                additions.append(f"ALTER TABLE `{database}`.`{table}` ON CLUSTER `{cluster}` "
                                 f"ADD COLUMN IF NOT EXISTS `{name}` {definition}{after}")
    return additions


def sharding_updates(engines: dict[str, str], database: str, cluster: str) -> list[str]:
    """Statements that give each Distributed table (``engines``: name → ``engine_full``) its sharding key
    of :data:`SHARDING_KEYS`: its pending rows are sent on first, then it is replaced (it holds no rows of
    its own; rows stored before keep their shard). Like a migration, best run while writers are paused."""
    statements = []
    for table in DISTRIBUTED:
        engine, key = engines.get(table), SHARDING_KEYS[table]
        if engine is None or engine.replace(" ", "").endswith(f"{key})"):
            continue
        statements += [
            f"SYSTEM FLUSH DISTRIBUTED `{database}`.`{table}` ON CLUSTER `{cluster}`",
            f"CREATE OR REPLACE TABLE `{database}`.`{table}` ON CLUSTER `{cluster}` AS `{database}`.`{table}_local` "
            f"ENGINE = Distributed('{cluster}', '{database}', '{table}_local', {key})",
        ]
    return statements


def first_line(exc: BaseException) -> str:
    """An error's first line (at most 300 characters), for a message of one line."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]
