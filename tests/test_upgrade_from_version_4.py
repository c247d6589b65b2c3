"""A version-4 database is upgraded to typed tables that fold copies of a span, and loses nothing.

``fixtures/database_v4.sql`` is a version-4 database frozen as text: its DDL and its rows (two runs
that fork, an episode they agree on, and one request stored twice, in every table, as a retried
write under version 4 could leave it).  ``init_schema`` rebuilds the typed tables (migration 0005)
and makes ``kvtrace_tokens`` a view of ``kvtrace_requests``' arrays (0006): every row stays with its
values, the copy counts once, the saved queries answer as they do on a new database that received
the same spans through the Collector's path, a span written after the upgrade reaches the new tables
through the views, and a second init changes nothing.  An upgrade interrupted anywhere is finished by
the next one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace import queries
from kvtrace import semconv as sc
from kvtrace.collectors import schema
from kvtrace.db import connect
from test_schema_upgrade import schema_shape

VERSION_4 = Path(__file__).parent / "fixtures" / "database_v4.sql"
MIGRATIONS = ("0005_typed_tables_fold_copies", "0006_tokens_view_and_array_codecs", "0007_batch_composition",
              "0008_slot_and_rows_cut")
TYPED = schema.REBUILT_IN_0005  # version 4's typed tables: kvtrace_tokens a view since version 6
OTHER_TABLES = ("otel_traces", "otel_traces_trace_id_ts", "kvtrace_ingest_files")
PAIR = {"run_a": "v4-A", "run_b": "v4-B"}
SAVED = (("runs", {}), ("forks", PAIR), ("fork_attribution", PAIR),
         ("episode_timeline", {**PAIR, "episode": "ep"}), ("divergence_rates", {"run_prefix": "v4-"}),
         ("divergence_rates", {"run_prefix": "v4-", "baseline_arm": "off"}), ("margin_shift", {}),
         ("flip_rate_by_margin", {}), ("near_tie_share", {}), ("cache_paths", PAIR))


@pytest.fixture
def open_db(kvtrace_env):
    """Opens embedded databases under the test's directory (one at a time: chDB serves one path per process)."""
    opened = []

    def open_(name: str):
        client = connect(f"chdb://{kvtrace_env / name}")
        opened.append(client)
        return client

    yield open_
    for client in opened:
        client.close()


def fixture_statements() -> list[str]:
    return schema.split_statements(VERSION_4.read_text())


def load_version_4(client) -> None:
    for statement in fixture_statements():
        client.command(statement)


LATER_COLUMNS = ("batch_composition", "step_rows", "step_tokens", "prefill_steps", "batch_rows", "batch_tokens",
                 "slot_selected_by", "rows_cut_at", "rows_cut_reason")
"""Columns versions 7 and 8 added, which rows stored before have empty (checked apart)."""


def rows(client, table: str, final: bool = False) -> list[str]:
    """Every row as text, its columns of version 4 by name (a rebuilt table's column order does not matter),
    sorted."""
    columns = [r[0] for r in client.query(
        "SELECT name FROM system.columns WHERE database = currentDatabase() AND table = {t:String} "
        "AND default_kind NOT IN ('ALIAS', 'MATERIALIZED') ORDER BY name", parameters={"t": table}).result_rows
        if r[0] not in LATER_COLUMNS]
    listed = ", ".join(f"`{c}`" for c in columns)
    found = client.query(f"SELECT {listed} FROM {table} {'FINAL' if final else ''}").result_rows
    return sorted(repr(row) for row in found)


def table_names(client) -> set[str]:
    return {r[0] for r in client.query("SELECT name FROM system.tables WHERE database = currentDatabase()").result_rows}


def answers(client) -> list[str]:
    """Every saved query's answer, as text (NaN compares equal to itself that way)."""
    return [repr(queries.run(client, name, params)) for name, params in SAVED]


def test_a_version_4_database_is_rebuilt_keeps_every_row_and_counts_a_copy_once(open_db, capsys):
    client = open_db("db")
    load_version_4(client)
    assert schema.schema_version(client) == 4
    stored = {t: rows(client, t) for t in TYPED + OTHER_TABLES}
    copied = {t: len(r) - len(set(r)) for t, r in stored.items()}
    assert copied == {"kvtrace_requests": 1, "kvtrace_tokens": 3, "kvtrace_cache_events": 1, "otel_traces": 1,
                      "otel_traces_trace_id_ts": 1, "kvtrace_ingest_files": 0}

    change = schema.init_schema(client)
    assert (change.version_before, change.version, change.applied) == (4, 8, MIGRATIONS)
    assert client.query("SELECT version, name FROM kvtrace_schema_migrations ORDER BY version").result_rows == [
        (m.version, m.name) for m in schema.migrations()]
    engines = client.query("SELECT name, engine, sorting_key FROM system.tables WHERE database = currentDatabase() "
                           "AND name IN ('kvtrace_requests', 'kvtrace_tokens', 'kvtrace_cache_events') ORDER BY name")
    assert engines.result_rows == [
        ("kvtrace_cache_events", "ReplacingMergeTree",
         "run_id, episode_id, turn, Timestamp, TraceId, SpanId, event_index"),
        ("kvtrace_requests", "ReplacingMergeTree", "run_id, episode_id, turn, Timestamp, TraceId, SpanId"),
        ("kvtrace_tokens", "View", "")]
    assert not any(name.endswith("_rebuilt") or name == "kvtrace_tokens_mv" for name in table_names(client))
    for table in TYPED:  # every row kept, with its values (the tokens as the view's); the copy folded into one
        assert rows(client, table, final=table != "kvtrace_tokens") == sorted(set(stored[table])), table
    for table in OTHER_TABLES:  # untouched
        assert rows(client, table) == stored[table], table
    # The digest the fork queries compare, for rows stored before it existed: computed as they are read.
    assert client.query("SELECT countIf(token_digest != cityHash64(token_ids)), count() FROM kvtrace_requests"
                        ).result_rows == [(0, len(set(stored["kvtrace_requests"])))]
    # Version 7's and 8's columns: nothing recorded for the rows stored before.
    assert client.query("SELECT DISTINCT batch_composition, step_rows, step_tokens, prefill_steps, slot_selected_by, "
                        "rows_cut_at, rows_cut_reason FROM kvtrace_requests"
                        ).result_rows == [("", [], [], [], "", 0, "")]

    # The saved queries: the fork is where it was, and the request stored twice counts once.
    runs = {r[0]: r for r in queries.run(client, "runs", {})[1]}
    assert {run: (row[6], row[7]) for run, row in runs.items()} == {"v4-A": (3, 8), "v4-B": (3, 8)}
    columns, forks = queries.run(client, "forks", PAIR)
    assert [(f["episode_id"], f["forked"], f["fork_turn"], f["position"], f["turns_a"])
            for f in (dict(zip(columns, row)) for row in forks)] == [("calm", 0, -1, -1, 1), ("ep", 1, 1, 1, 2)]
    columns, (fork,) = queries.run(client, "fork_attribution", PAIR)
    fork = dict(zip(columns, fork))
    assert (fork["episode_id"], fork["attribution"], fork["culprit_run"], fork["culprit_event"],
            fork["culprit_source_turn"]) == ("ep", sc.ATTRIBUTION_HIT_VS_RECOMPUTE, "v4-A", sc.EVENT_CACHE_RESTORE, 0)
    upgraded = answers(client)

    # A span written after the upgrade (a Collector's row: a copy of run A's restoring request under a new
    # run and span id) reaches the new tables through the views the current DDL created again.
    client.command(f"INSERT INTO otel_traces SELECT * REPLACE ("
                   f"mapUpdate(SpanAttributes, map('{sc.RUN_ID}', 'v4-C')) AS SpanAttributes, 'c0ffee' AS SpanId) "
                   f"FROM (SELECT * FROM otel_traces WHERE SpanAttributes['{sc.RUN_ID}'] = 'v4-A' "
                   f"AND SpanAttributes['{sc.TURN}'] = '1' LIMIT 1)")
    counts = [client.query(f"SELECT count() FROM {t} {'' if t == 'kvtrace_tokens' else 'FINAL'} "
                           "WHERE run_id = 'v4-C' AND SpanId = 'c0ffee'").result_rows[0][0] for t in TYPED]
    assert counts == [1, 3, 1]

    # A second init changes nothing.
    shape = schema_shape(client)
    assert schema.init_schema(client).applied == ()
    assert schema_shape(client) == shape
    assert main_says_nothing_to_upgrade(capsys)
    client.close()

    # The same spans through the Collector's path into a new database: the same answers.
    fresh = open_db("collector")
    schema.init_schema(fresh)
    (spans,) = [s for s in fixture_statements() if s.startswith("INSERT INTO `default`.`otel_traces` ")]
    fresh.command(spans)
    assert answers(fresh) == upgraded
    assert schema_shape(fresh) == shape


def main_says_nothing_to_upgrade(capsys) -> bool:
    from kvtrace.cli import main

    capsys.readouterr()
    return main(["db", "init"]) == 0 and "schema version 8, nothing to upgrade" in capsys.readouterr().out


@pytest.mark.parametrize("stop_at", [
    ("INSERT INTO `default`.`kvtrace_requests_rebuilt`", 1),  # requests copied, not exchanged
    ("EXCHANGE TABLES `default`.`kvtrace_requests`", 1),  # exchanged, the old table not dropped
    ("INSERT INTO `default`.`kvtrace_tokens_rebuilt`", 0),  # requests rebuilt, tokens' new table empty
    None,  # the whole migration ran, no version recorded
])
def test_an_interrupted_rebuild_is_finished_by_the_next_init(open_db, stop_at):
    client = open_db("db")
    load_version_4(client)
    stored = {t: sorted(set(rows(client, t))) for t in TYPED}
    statements = schema.render_migration(schema.migrations()[4])
    stop = len(statements) if stop_at is None else next(
        i for i, s in enumerate(statements) if s.startswith(stop_at[0])) + stop_at[1]
    for statement in statements[:stop]:
        client.command(statement)
    assert schema.schema_version(client) == 4
    assert schema.init_schema(client).applied == MIGRATIONS
    for table in TYPED:
        view = table == "kvtrace_tokens"
        assert rows(client, table, final=not view) == stored[table], table
        assert client.query(f"SELECT engine FROM system.tables WHERE database = currentDatabase() AND name = '{table}'"
                            ).result_rows == [("View" if view else "ReplacingMergeTree",)]
    assert not any(name.endswith("_rebuilt") for name in table_names(client))
