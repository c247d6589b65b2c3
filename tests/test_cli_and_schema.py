"""The CLI behaves like a good CLI; the schema is the Collector's and renders for clusters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtrace.cli import main
from kvtrace.collectors.schema import REBUILT_IN_0005, migrations, render_ddl, render_migration


def kvtrace(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_selfcheck_init_query_and_status_end_to_end():
    assert "kvtrace" in kvtrace("--help").stdout
    assert "schema ready" in kvtrace("db", "init").stdout
    assert "schema ready" in kvtrace("db", "init").stdout  # idempotent
    selfcheck = kvtrace("selfcheck", "--requests", "6").stdout
    assert "selfcheck passed" in selfcheck
    # vLLM loads kvtrace's plugin wherever it is installed: the selfcheck says when that records.
    assert ("vLLM: kvtrace's plugin records only processes started by `kvtrace run` or with KVTRACE_ENABLED=1 "
            "(their workers inherit it); this environment is not: installing kvtrace alone records nothing"
            in selfcheck)
    runs = json.loads(kvtrace("query", "runs", "--format", "json").stdout)
    assert len(runs) == 1 and runs[0]["requests"] == 6 and runs[0]["output_tokens"] == 6 * 32
    status = json.loads(kvtrace("db", "status", "--format", "json").stdout)
    assert status["tables"]["kvtrace_tokens"] == 6 * 32
    csv_out = kvtrace("query", "runs", "--format", "csv").stdout.splitlines()
    assert csv_out[0].startswith("run_id,") and len(csv_out) == 2


def test_bad_input_gets_a_clear_error_and_exit_code(capsys):
    assert main(["query", "no_such_query"]) == 2
    assert "no saved query named 'no_such_query'" in capsys.readouterr().err
    assert main(["query", "runs", "--param", "bogus=1"]) == 2
    assert "has no parameter bogus" in capsys.readouterr().err
    assert main(["--db", "mysql://x", "db", "init"]) == 2
    assert "not understood" in capsys.readouterr().err
    assert main(["--db", "http://127.0.0.1:9", "db", "init"]) == 1
    assert "cannot reach ClickHouse" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2



def test_the_shared_options_count_after_the_command_and_its_own_command_too(capsys, tmp_path):
    assert main(["db", "status", "--db", "mysql://x"]) == 2
    assert "not understood" in capsys.readouterr().err
    assert main(["--db", "mysql://x", "runs", "--format", "json", "--db", f"chdb://{tmp_path / 'after'}"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert (tmp_path / "after").is_dir()
    from kvtrace.cli import build_parser
    before = ["--db", "chdb://memory", "-q", "db", "ingest"]
    args = build_parser(before).parse_args(before)  # left out after the command, what came before stands
    assert (args.db, args.quiet, args.verbose, args.spool_dir) == ("chdb://memory", True, False, None)
    after = ["db", "ingest", "--spool-dir", "s", "-v"]
    args = build_parser(after).parse_args(after)
    assert (args.db, args.quiet, args.verbose, args.spool_dir) == (None, False, True, "s")

def test_otel_traces_is_the_collector_exporters_table(db):
    columns = db.query("SELECT name, type FROM system.columns WHERE database = currentDatabase() "
                       "AND table = 'otel_traces' ORDER BY position").result_rows
    assert [c[0] for c in columns][:15] == [
        "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind", "ServiceName",
        "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration", "StatusCode",
        "StatusMessage"]
    types = dict(columns)
    assert types["Timestamp"] == "DateTime64(9)" and types["Duration"] == "UInt64"
    assert types["Events.Attributes"] == "Array(Map(LowCardinality(String), String))"
    keys = db.query("SELECT partition_key, sorting_key, primary_key FROM system.tables "
                    "WHERE database = currentDatabase() AND name = 'otel_traces'").result_rows[0]
    assert keys == ("toDate(Timestamp)", "ServiceName, SpanName, toDateTime(Timestamp), Timestamp",
                    "ServiceName, SpanName, toDateTime(Timestamp)")


def test_cluster_ddl_uses_replicated_local_tables_behind_distributed_ones():
    ddl = render_ddl("otel", cluster="prod")
    assert all("ON CLUSTER `prod`" in statement for statement in ddl)
    traces = next(s for s in ddl if "`otel`.`otel_traces_local`" in s and s.startswith("CREATE TABLE"))
    assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')" in traces
    distributed = [s for s in ddl if "ENGINE = Distributed" in s]
    assert {s.split()[5] for s in distributed} == {
        "`otel`.`otel_traces`", "`otel`.`otel_traces_trace_id_ts`", "`otel`.`kvtrace_requests`",
        "`otel`.`kvtrace_cache_events`"}
    # Sharded by run (typed tables) or trace (otel_traces): copies of a span meet on one shard and fold.
    keys = {s.split()[5].split(".")[1].strip("`"): s.rsplit(", ", 1)[1] for s in distributed}
    by_trace, by_run = "cityHash64(TraceId))", "cityHash64(run_id))"
    assert keys == {"otel_traces": by_trace, "otel_traces_trace_id_ts": by_trace, "kvtrace_requests": by_run,
                    "kvtrace_cache_events": by_run}
    # The tokens view reads every shard: the Distributed kvtrace_requests, created before it.
    view = next(s for s in ddl if "VIEW `otel`.`kvtrace_tokens`" in s)
    assert "FROM `otel`.`kvtrace_requests` FINAL" in view
    assert ddl.index(view) > ddl.index(next(s for s in distributed if "`otel`.`kvtrace_requests`" in s))
    mv = next(s for s in ddl if "`kvtrace_requests_mv`" in s)
    assert "TO `otel`.`kvtrace_requests_local`" in mv and "FROM `otel`.`otel_traces_local`" in mv
    with pytest.raises(ValueError):
        render_ddl("otel; DROP TABLE x", cluster=None)
    single = render_ddl("default")
    assert not any("ON CLUSTER" in s or "Replicated" in s for s in single)


def test_cluster_print_shows_typed_tables_that_fold_copies_and_the_rebuild_addresses_every_node(capsys):
    assert main(["db", "init", "--cluster", "prod", "--database", "otel", "--print"]) == 0
    printed = capsys.readouterr().out
    for table, key in (("kvtrace_requests", "Timestamp, TraceId, SpanId"),
                       ("kvtrace_cache_events", "Timestamp, TraceId, SpanId, event_index")):
        statement = next(s for s in printed.split(";\n") if f"CREATE TABLE IF NOT EXISTS `otel`.`{table}_local`" in s)
        assert "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{uuid}/{shard}', '{replica}')" in statement
        assert f"ORDER BY (run_id, episode_id, turn, {key})" in statement

    (rebuild,) = [m for m in migrations() if m.version == 5]
    statements = render_migration(rebuild, "otel", cluster="prod")
    inserts = [s for s in statements if s.startswith("INSERT")]
    assert all(" ON CLUSTER `prod`" in s for s in statements if s not in inserts)  # an INSERT runs on one node
    # Each local table is rebuilt on every node; the copy reads through the Distributed table, writes to every shard.
    assert [s.split("\n")[0] for s in inserts] == [
        f"INSERT INTO FUNCTION cluster('prod', 'otel', '{t}_rebuilt_local', cityHash64(run_id)) (" for t in REBUILT_IN_0005]
    assert [s.split("\n")[-2:] for s in inserts] == [
        [f"FROM `otel`.`{t}`", "SETTINGS insert_distributed_sync = 1"] for t in REBUILT_IN_0005]
    assert [s for s in statements if s.startswith("EXCHANGE")] == [
        f"EXCHANGE TABLES `otel`.`{t}_local` AND `otel`.`{t}_rebuilt_local` ON CLUSTER `prod`" for t in REBUILT_IN_0005]
    created = [s for s in statements if s.startswith("CREATE TABLE")]
    assert len(created) == 3 and all("ReplicatedReplacingMergeTree('/clickhouse/tables/{uuid}/{shard}'" in s
                                     for s in created)
    # Version 6 drops the tokens table (its rows are kvtrace_requests' arrays): the Distributed one, then the local.
    (tokens_view,) = [m for m in migrations() if m.version == 6]
    assert [s for s in render_migration(tokens_view, "otel", cluster="prod") if s.startswith("DROP TABLE")] == [
        "DROP TABLE IF EXISTS `otel`.`kvtrace_tokens` ON CLUSTER `prod` SYNC",
        "DROP TABLE IF EXISTS `otel`.`kvtrace_tokens_local` ON CLUSTER `prod` SYNC"]


def test_a_cluster_upgrade_reshards_only_distributed_tables_sharded_otherwise():
    from kvtrace.collectors.schema import sharding_updates

    engines = {"kvtrace_requests": "Distributed('prod', 'otel', 'kvtrace_requests_local', rand())",
               "kvtrace_tokens": "Distributed('prod', 'otel', 'kvtrace_tokens_local', cityHash64(run_id))",
               "otel_traces": "Distributed('prod', 'otel', 'otel_traces_local', rand())"}
    statements = sharding_updates(engines, "otel", "prod")
    assert statements == [
        "SYSTEM FLUSH DISTRIBUTED `otel`.`otel_traces` ON CLUSTER `prod`",
        "CREATE OR REPLACE TABLE `otel`.`otel_traces` ON CLUSTER `prod` AS `otel`.`otel_traces_local` "
        "ENGINE = Distributed('prod', 'otel', 'otel_traces_local', cityHash64(TraceId))",
        "SYSTEM FLUSH DISTRIBUTED `otel`.`kvtrace_requests` ON CLUSTER `prod`",
        "CREATE OR REPLACE TABLE `otel`.`kvtrace_requests` ON CLUSTER `prod` AS `otel`.`kvtrace_requests_local` "
        "ENGINE = Distributed('prod', 'otel', 'kvtrace_requests_local', cityHash64(run_id))"]
    # Run again once resharded: nothing left to do.
    resharded = {table: statement.split("ENGINE = ", 1)[1]
                 for table, statement in (("otel_traces", statements[1]), ("kvtrace_requests", statements[3]))}
    assert sharding_updates({**engines, **resharded}, "otel", "prod") == []
