"""A user of the first release upgrades kvtrace: the database keeps every run and gains the new columns.

The first release's schema is frozen in ``fixtures/schema_v1.sql`` (what its ``kvtrace db init``
ran).  Two runs that fork and an imported log were stored under it.  The next ``kvtrace`` command
upgrades the database on open: the old runs still answer ``runs`` and ``diff``, a log imported
after the upgrade fills the columns version 2 added, and opening it again changes nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import correlate
from kvtrace import semconv as sc
from kvtrace.cli import main
from kvtrace.collectors import schema
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.otlp_rows import COLUMNS, rows_from_request
from kvtrace.db import connect

FIRST_RELEASE_DDL = Path(__file__).parent / "fixtures" / "schema_v1.sql"
VERSION_3_DDL = Path(__file__).parent / "fixtures" / "schema_v3.sql"
SOURCE_COLUMNS = ("prompt_hash_source", "reused_tokens_source", "token_id_source")
A, B = "before-A", "before-B"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture
def open_db(kvtrace_env):
    """Opens embedded databases under the test's directory; closes them all afterwards, failed or not.

    chDB serves one on-disk path per process at a time: a test closes one before it opens another.
    """
    opened = []

    def open_(name: str = "db", first_release: bool = False):
        client = connect(f"chdb://{kvtrace_env / name}")
        opened.append(client)
        if first_release:  # the tables and views the first release's `kvtrace db init` created
            for statement in schema.split_statements(FIRST_RELEASE_DDL.read_text()):
                client.command(statement)
        return client

    yield open_
    for client in opened:
        client.close()


def store_as_the_first_release_did(client, spool: Path) -> None:
    """Spool lines → rows of otel_traces (what its ingest, like a Collector, wrote); its views did the rest."""
    for path in sorted(spool.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            client.insert("otel_traces", list(rows_from_request(line)), column_names=COLUMNS)


def logged_exchange(episode: str, turn: int, tokens: list[str], cached: int) -> dict:
    """One line of an OpenAI-compatible request/response log: token strings, top-2 logprobs, cached tokens."""
    content = [{"token": t, "logprob": -0.1, "top_logprobs": [{"token": t, "logprob": -0.1},
                                                              {"token": t + "?", "logprob": -0.6}]} for t in tokens]
    return {"episode_id": episode, "request_index": turn,
            "request": {"model": "served", "messages": [{"role": "user", "content": f"turn {turn}"}],
                        "logprobs": True, "top_logprobs": 2, "temperature": 0},
            "response": {"object": "chat.completion", "model": "served",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tokens)},
                                      "logprobs": {"content": content}, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 20, "completion_tokens": len(tokens),
                                   "prompt_tokens_details": {"cached_tokens": cached}}}}


def write_log(path: Path) -> Path:
    lines = [logged_exchange("e0", 0, ["a", "b", "c"], 0), logged_exchange("e0", 1, ["d", "e"], 16)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def source_columns(client, run_id: str) -> list[tuple]:
    return client.query(f"SELECT turn, {', '.join(SOURCE_COLUMNS)} FROM kvtrace_requests "
                        "WHERE run_id = {run:String} ORDER BY turn", parameters={"run": run_id}).result_rows


def schema_shape(client) -> dict:
    """Every column (name, type, position, default, codec) and every view's definition."""
    columns = client.query("SELECT table, name, type, position, default_kind, default_expression, compression_codec "
                           "FROM system.columns WHERE database = currentDatabase() ORDER BY table, position").result_rows
    views = client.query("SELECT name, create_table_query FROM system.tables WHERE database = currentDatabase() "
                         "AND engine IN ('MaterializedView', 'View') ORDER BY name").result_rows
    return {"columns": columns, "views": views}


def test_a_first_release_database_is_upgraded_on_open_and_keeps_its_runs(kvtrace_env, spool_dir, open_db, capsys):
    old_spool = kvtrace_env / "first-release-spool"

    # Under the first release: a request log was imported (its spans name their sources; the first
    # release's view dropped them) ...
    assert main(["-q", "import", str(write_log(kvtrace_env / "old.jsonl")), "--run-id", "logged-before",
                 "--no-ingest"]) == 0
    old_spool.mkdir()
    for path in spool_dir.glob("*.jsonl"):
        shutil.move(path, old_spool / path.name)
    # ... and two runs of one episode forked where run A restored a prompt-cache state.
    book = ScenarioBook(old_spool)
    for run in (A, B):
        book.turn(run, "ep", 0, PROMPT, [10, 11, 12], arm="cache" if run == A else "off")
    restore = CachePath(sc.LAYER_PROMPT_CACHE, 11, "key-1", book.records[(A, "ep", 0)].origin(),
                        sc.EVENT_CACHE_RESTORE)
    book.turn(A, "ep", 1, PROMPT + [10, 11, 12, 20], [40, 41, 42], [1.0, 0.01, 1.0], cache=restore, arm="cache")
    book.turn(B, "ep", 1, PROMPT + [10, 11, 12, 20], [40, 43, 42], [1.0, 0.02, 1.0], arm="off")
    book.recorder.pipeline.force_flush()
    old = open_db(first_release=True)
    store_as_the_first_release_did(old, old_spool)
    assert "reused_tokens_source" not in {row[0] for row in old.query("DESCRIBE TABLE kvtrace_requests").result_rows}
    assert schema.schema_version(old) == 1  # kvtrace tables, no recorded version
    old.close()

    # The user installs this version; the first command that opens the database upgrades it.
    assert main(["-q", "runs", "--format", "json"]) == 0
    runs = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(runs) == {A, B, "logged-before"}
    assert (runs[A]["requests"], runs[A]["output_tokens"], runs[A]["cached_prompt_tokens"]) == (2, 6, 11)
    assert runs["logged-before"]["cached_prompt_tokens"] == 16

    assert main(["-q", "diff", A, B, "--format", "json"]) == 0
    (fork,) = json.loads(capsys.readouterr().out)
    assert (fork["episode"], fork["turn"], fork["position"], fork["attribution"]) == ("ep", 1, 1, "hit_vs_recompute")
    assert fork["culprit"]["event"] == sc.EVENT_CACHE_RESTORE

    # A log imported now fills the new columns; the rows stored before the upgrade keep them empty.
    assert main(["-q", "import", str(write_log(kvtrace_env / "new.jsonl")), "--run-id", "logged-after"]) == 0
    capsys.readouterr()
    client = open_db()
    filled = (sc.PROMPT_HASH_SOURCE_REQUEST_TEXT, sc.REUSED_SOURCE_OPENAI_USAGE, sc.TOKEN_ID_SOURCE_TEXT_HASH)
    assert source_columns(client, "logged-after") == [(0, *filled), (1, *filled)]
    assert source_columns(client, "logged-before") == [(0, "", "", ""), (1, "", "", "")]
    assert client.query("SELECT version, name FROM kvtrace_schema_migrations ORDER BY version").result_rows == [
        (m.version, m.name) for m in schema.migrations()]
    client.close()

    assert main(["-q", "db", "status", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema_version"] == schema.latest_version() == 8
    assert main(["db", "init"]) == 0
    assert "schema version 8, nothing to upgrade" in capsys.readouterr().out
    client = open_db()
    assert client.query("SELECT count() FROM kvtrace_schema_migrations").result_rows == [(8,)]


def test_an_upgraded_database_has_exactly_the_schema_of_a_new_one(open_db):
    upgraded = open_db("upgraded", first_release=True)
    change = schema.init_schema(upgraded)
    assert (change.version_before, change.version, change.applied) == (
        1, 8, ("0002_outside_recording_sources", "0003_typed_request_arrays", "0004_request_spans_text_in_database",
               "0005_typed_tables_fold_copies", "0006_tokens_view_and_array_codecs", "0007_batch_composition",
               "0008_slot_and_rows_cut"))
    upgraded_shape = schema_shape(upgraded)
    upgraded.close()

    new = open_db("new")
    change = schema.init_schema(new)
    assert (change.version_before, change.version, change.applied) == (0, 8, ())
    assert schema.schema_version(new) == 8
    assert schema_shape(new) == upgraded_shape
    assert any(column[1] == "reused_tokens_source" for column in upgraded_shape["columns"])


def test_a_version_3_database_stores_request_spans_once_after_its_upgrade(open_db, spool_recorder, spool_dir,
                                                                            tmp_path):
    # Version 3 sent request spans twice: to otel_traces with the arrays' text, and to kvtrace_request_arrays.
    client = open_db("version-3")
    for statement in schema.split_statements(VERSION_3_DDL.read_text()):
        client.command(statement)
    client.insert(schema.VERSIONS_TABLE, [[1, "baseline"], [2, "outside_recording_sources"], [3, "typed_request_arrays"]],
                  column_names=["version", "name"])
    assert schema.schema_version(client) == 3

    assert schema.init_schema(client).applied == ("0004_request_spans_text_in_database", "0005_typed_tables_fold_copies",
                                                  "0006_tokens_view_and_array_codecs", "0007_batch_composition",
                                                  "0008_slot_and_rows_cut")
    names = {row[0] for row in client.query("SELECT name FROM system.tables WHERE database = currentDatabase()")
             .result_rows}
    assert not names & {"kvtrace_request_arrays", "kvtrace_request_arrays_mv"}
    with correlate(run_id="after-upgrade", episode_id="e", turn=0):
        rec = spool_recorder.start_request("test_engine")
    for i, margin in enumerate([0.25, 1e21, -0.0]):
        rec.add_token(i, i, i + 1, margin, -1.5)
    spool_recorder.finish(rec)
    spool_recorder.pipeline.force_flush()
    assert ingest_paths(client, [spool_dir], quarantine_dir=tmp_path / "q").spans == 1
    assert client.query("SELECT margins, token_ids FROM kvtrace_requests").result_rows == [([0.25, 1e21, 0.0], [0, 1, 2])]
    assert client.query("SELECT count() FROM kvtrace_tokens").result_rows == [(3,)]
    # The span's row in otel_traces is for trace viewers: its arrays are stored once, in kvtrace's tables.
    assert client.query(f"SELECT mapContains(SpanAttributes, '{sc.OUTPUT_MARGINS}'), "
                        f"SpanAttributes['{sc.TYPED_ROWS_STORED}'] != '' FROM otel_traces").result_rows == [(0, 1)]
    assert "non_replicated_deduplication_window = 10000" in client.query(
        "SELECT create_table_query FROM system.tables WHERE database = currentDatabase() AND name = 'otel_traces'"
    ).result_rows[0][0]
    upgraded_shape = schema_shape(client)
    client.close()

    new = open_db("new")
    schema.init_schema(new)
    assert schema_shape(new) == upgraded_shape


def test_an_interrupted_upgrade_is_finished_by_the_next_open_and_a_double_record_is_one_version(open_db):
    client = open_db(first_release=True)
    # Another upgrader added the columns and stopped (or is still running) before recording anything.
    for statement in schema.render_migration(schema.migrations()[1]):
        client.command(statement)
    assert schema.schema_version(client) == 1
    assert schema.init_schema(client).applied == ("0002_outside_recording_sources",  # runs it again, harmlessly
                                                  "0003_typed_request_arrays", "0004_request_spans_text_in_database",
                                                  "0005_typed_tables_fold_copies", "0006_tokens_view_and_array_codecs",
                                                  "0007_batch_composition", "0008_slot_and_rows_cut")
    # ... then it records the versions as well: the same versions twice.
    client.insert(schema.VERSIONS_TABLE, [[m.version, m.name] for m in schema.migrations()],
                  column_names=["version", "name"])
    assert schema.schema_version(client) == 8
    assert schema.init_schema(client).applied == ()
    columns = [row[0] for row in client.query("DESCRIBE TABLE kvtrace_requests").result_rows]
    assert [c for c in columns if c.endswith("_source")] == ["prompt_hash_source", "reused_tokens_source",
                                                            "token_id_source"]
    view = client.query("SELECT as_select FROM system.tables WHERE name = 'kvtrace_requests_mv'").result_rows[0][0]
    assert all(f"AS {column}" in view for column in SOURCE_COLUMNS)


def test_a_failed_migration_says_which_and_records_nothing(open_db, capsys):
    client = open_db(first_release=True)
    client.command("DROP TABLE kvtrace_requests_mv")
    client.command("RENAME TABLE kvtrace_requests TO kvtrace_requests_moved")
    client.command("CREATE VIEW kvtrace_requests AS SELECT 1 AS x")  # not a table: ALTER … ADD COLUMN fails
    client.close()
    assert main(["-q", "runs"]) == 1
    err = capsys.readouterr().err
    assert "from schema version 1 to 8: migration 0002_outside_recording_sources failed" in err
    assert "Traceback" not in err
    assert schema.schema_version(open_db()) == 1


def test_init_print_shows_the_new_schema_and_cluster_upgrades_address_every_node():
    printed = schema.render_ddl("default")
    assert any("CREATE TABLE IF NOT EXISTS `default`.`kvtrace_schema_migrations`" in s for s in printed)
    assert any("reused_tokens_source LowCardinality(String)" in s for s in printed)

    (alter,) = schema.render_migration(schema.migrations()[1], "otel", cluster="prod")
    assert alter.startswith("ALTER TABLE `otel`.`kvtrace_requests_local` ON CLUSTER `prod`")
    views = schema.render_view_queries("otel", cluster="prod")
    assert len(views) == len(schema.VIEWS)
    assert all(" ON CLUSTER `prod` MODIFY QUERY SELECT" in v for v in views)
    requests_view = next(v for v in views if "`otel`.`kvtrace_requests_mv`" in v)
    assert "FROM `otel`.`otel_traces_local`" in requests_view and "AS reused_tokens_source" in requests_view
    versions = next(s for s in schema.render_ddl("otel", cluster="prod") if "kvtrace_schema_migrations" in s)
    assert "ReplicatedMergeTree('/clickhouse/tables/all_shards/" in versions


def test_distributed_tables_get_the_columns_their_local_tables_gained(open_db):
    # chDB has no cluster; plain tables stand in for a Distributed table and the local table behind it.
    client = open_db()
    client.command("CREATE DATABASE otel")
    client.command("CREATE TABLE otel.kvtrace_requests_local (a String, b String, c UInt32, "
                   "d UInt64 MATERIALIZED cityHash64(a)) ENGINE = MergeTree ORDER BY a")
    client.command("CREATE TABLE otel.kvtrace_requests (a String, c UInt32) ENGINE = MergeTree ORDER BY a")
    assert schema.distributed_column_additions(client, "otel", "prod") == [
        "ALTER TABLE `otel`.`kvtrace_requests` ON CLUSTER `prod` ADD COLUMN IF NOT EXISTS `b` String AFTER `a`",
        "ALTER TABLE `otel`.`kvtrace_requests` ON CLUSTER `prod` ADD COLUMN IF NOT EXISTS `d` UInt64 MATERIALIZED "
        "cityHash64(a) AFTER `c`"]
