"""A query of some runs reads those runs' rows alone: the rest of the database changes neither its answer
nor what it reads, so it takes as long in a database of any size (benchmarks/query_latency.py --scale).

Half a million rows of other runs are stored beside the scenario's; each run-scoped query must still
answer the same within a read limit far below them (``max_rows_to_read``: the database refuses a query
that reads more, every subquery included).
"""

from __future__ import annotations

from kvtrace import queries
from test_queries_read_final import PAIR, scenario_database

RATES = {"run_prefix": "rates/"}
RUN_SCOPED = (("forks", PAIR), ("fork_attribution", PAIR), ("divergence_rates", {**RATES, "baseline_arm": "off"}),
              ("cache_paths", PAIR), ("episode_timeline", {**PAIR, "episode": "hit"}),
              ("replay_requests", {"run": "A"}),
              ("flip_rate_by_batch_rows", PAIR), ("margin_shift", RATES), ("near_tie_share", RATES),
              ("flip_rate_by_margin", RATES), ("integrity_violation_counts", RATES))
OTHER_ROWS = 500_000
READ_LIMIT = {"max_rows_to_read": OTHER_ROWS // 4}


def answers(client, limit: dict) -> list[str]:
    """Each run-scoped query's rows, run as queries.run runs it, within ``limit``."""
    settings = {**queries.ANALYSIS_SETTINGS, **limit}
    return [repr(client.query(query.sql, parameters=query.bind(params), settings=settings).result_rows)
            for query, params in ((queries.load(name), params) for name, params in RUN_SCOPED)]


def test_run_scoped_queries_read_none_of_the_other_runs_rows(tmp_path):
    client = scenario_database(tmp_path)
    try:
        alone = answers(client, {})
        assert alone.count("[]") == 1  # flip_rate_by_batch_rows: the scenario records no batch composition
        # Other runs' requests (one row each, no arrays) in the same partition as the scenario's.
        client.command(
            "INSERT INTO kvtrace_requests (Timestamp, TraceId, SpanId, run_id, episode_id, turn) "
            "SELECT (SELECT max(Timestamp) FROM kvtrace_requests), hex(cityHash64(number, 't')), "
            "hex(cityHash64(number)), concat('other/', toString(number % 50)), toString(number % 1000), "
            f"toInt32(intDiv(number, 50000)) FROM numbers({OTHER_ROWS})")
        client.command("OPTIMIZE TABLE kvtrace_requests FINAL")
        assert answers(client, READ_LIMIT) == alone
    finally:
        client.close()
