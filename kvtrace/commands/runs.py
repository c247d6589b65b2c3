"""``kvtrace runs``: the runs the database holds, with configuration and counts."""

from __future__ import annotations

from kvtrace import queries
from kvtrace.analysis.tables import print_rows
from kvtrace.commands.common import open_database


def add_arguments(p) -> None:
    p.description = ("One line per run: engine, model, weight formats, arms, episodes, "
                     "requests, generated and cache-served tokens, first and last request, shadow twins "
                     "(kvtrace proxy --shadow), cache integrity violations.")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.set_defaults(func=run)


def run(args) -> int:
    client = open_database(args)
    columns, rows = queries.run(client, "runs")
    print_rows(columns, rows, args.format)
    return 0
