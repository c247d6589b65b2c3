"""A span stored twice counts once: every saved query answers the same after its rows are written again.

The typed tables fold copies of a span only when the engine merges their parts, which it does at a
time of its own; the saved queries read the final state.  Here the copies are kept apart (merges
stopped), so a query that read the tables as stored would count them twice.
"""

from __future__ import annotations

from diff_scenarios import ScenarioBook, record_fork_scenarios
from kvtrace import queries
from kvtrace.collectors.schema import SPAN_TABLES, init_schema
from kvtrace.db import connect
from test_queries_rates import FORKED, record_pass

PAIR = {"run_a": "A", "run_b": "B"}
SAVED = (("runs", {}), ("forks", PAIR), ("fork_attribution", PAIR), ("episode_timeline", {**PAIR, "episode": "hit"}),
         ("cache_paths", PAIR), ("divergence_rates", {"run_prefix": "rates/", "baseline_arm": "off"}),
         ("divergence_rates", {"run_prefix": "rates/"}), ("margin_shift", {"run_prefix": "rates/"}),
         ("flip_rate_by_margin", {"run_prefix": "rates/"}), ("near_tie_share", {}))


def answers(client) -> list[str]:
    return [repr(queries.run(client, name, params)) for name, params in SAVED]


def counts(client) -> list[int]:
    return [client.query(f"SELECT count() FROM {table}").result_rows[0][0] for table in SPAN_TABLES]


def scenario_database(tmp_path):
    """A database of two forked runs and four passes of the rates' episodes (two arms)."""
    book = ScenarioBook(tmp_path / "spool")
    record_fork_scenarios(book, "A", "B")
    for r in range(2):
        record_pass(book, f"rates/off/r{r}", "off")
        record_pass(book, f"rates/reuse/r{r}", "reuse", FORKED)
    client = connect(f"chdb://{tmp_path / 'db'}")
    try:
        init_schema(client)
        book.ingest(client)
    except BaseException:
        client.close()
        raise
    return client


def test_every_saved_query_counts_a_span_stored_twice_once(tmp_path):
    client = scenario_database(tmp_path)
    try:
        for table in SPAN_TABLES:
            client.command(f"OPTIMIZE TABLE {table} FINAL")
            client.command(f"SYSTEM STOP MERGES {table}")
        once, stored = answers(client), counts(client)
        assert all(stored) and "'hit_vs_recompute'" in once[2]

        tokens = client.query("SELECT count() FROM kvtrace_tokens").result_rows[0][0]

        # The same spans again.
        client.command("INSERT INTO kvtrace_requests SELECT * FROM kvtrace_requests")
        client.command("INSERT INTO kvtrace_cache_events SELECT * FROM kvtrace_cache_events")
        assert counts(client) == [2 * n for n in stored]
        assert answers(client) == once
        # The tokens view reads kvtrace_requests FINAL: the copies' tokens once.
        assert client.query("SELECT count() FROM kvtrace_tokens").result_rows[0][0] == tokens > 0
    finally:
        client.close()


def test_the_rewrites_saved_queries_run_without_change_no_answer(tmp_path):
    """queries.run turns some of ClickHouse's query-tree rewrites off for speed; with ClickHouse's
    defaults every saved query gives the same rows."""
    client = scenario_database(tmp_path)
    try:
        for name, params in SAVED:
            query = queries.load(name)
            bound = query.bind(params)
            rows = client.query(query.sql, parameters=bound, settings=queries.ANALYSIS_SETTINGS).result_rows
            assert rows, name
            assert repr(client.query(query.sql, parameters=bound).result_rows) == repr(rows), name
            assert repr(queries.run(client, name, params)[1]) == repr(rows), name
    finally:
        client.close()
