"""The saved queries on a cluster, where the tables they read are Distributed tables over shards
(`kvtrace db init --cluster`, docs/storage.md).

A subquery over a Distributed table inside the read of one (``requests_once``'s probe check) is refused by
ClickHouse's default (``distributed_product_mode = 'deny'``) on more than one shard; ``queries.run`` says
how to run it. chDB runs no server, but a cluster whose shards are all this process reads them in place:
here two shards over the scenario's one database. Each row is then read twice, so what is checked is that
every saved query runs, not its answer. The cluster is configured when the embedded engine starts, once a
process, so the check runs in a process of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent
CLUSTER = """<clickhouse>
  <tcp_port>9000</tcp_port>
  <remote_servers>
    <two>
      <shard><replica><host>localhost</host><port>9000</port></replica></shard>
      <shard><replica><host>127.0.0.1</host><port>9000</port></replica></shard>
    </two>
  </remote_servers>
</clickhouse>
"""
CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path
    import clickhouse_connect
    from kvtrace import queries
    from kvtrace.collectors.schema import SHARDING_KEYS
    from test_queries_read_final import SAVED, scenario_database

    root = Path(sys.argv[1])
    # the engine starts here, with the cluster; the scenario's client shares it
    engine = clickhouse_connect.get_client(dsn=f"chdb://{root / 'db'}",
                                           chdb_options={"config-file": str(root / "cluster.xml")})
    client = scenario_database(root)
    client.command("CREATE DATABASE sharded")
    for table in ("kvtrace_requests", "kvtrace_cache_events", "otel_traces"):
        client.command(f"CREATE TABLE sharded.{table} AS default.{table} "
                       f"ENGINE = Distributed('two', 'default', '{table}', {SHARDING_KEYS[table]})")
    client.database = "sharded"
    forks = queries.load("forks")
    try:
        client.query(forks.sql, parameters=forks.bind({"run_a": "A", "run_b": "B"}),
                     settings=queries.ANALYSIS_SETTINGS)
        print("ClickHouse's default ran a double-distributed query: the cluster is not in use")
    except Exception as exc:
        print("default:", "DISTRIBUTED_IN_JOIN_SUBQUERY_DENIED" in str(exc))
    for name, params in SAVED:
        queries.run(client, name, params)
        print("ran", name)
    client.close()
    engine.close()
""")


def test_every_saved_query_runs_through_distributed_tables_on_two_shards(tmp_path):
    (tmp_path / "cluster.xml").write_text(CLUSTER)
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], cwd=TESTS, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "default: True" in done.stdout  # without queries.run's setting, the cluster refuses them
    from test_queries_read_final import SAVED
    assert done.stdout.count("ran ") == len(SAVED)
