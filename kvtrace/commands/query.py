"""``kvtrace query NAME``: run a saved query with bound parameters."""

from __future__ import annotations

from kvtrace import queries
from kvtrace.analysis.tables import print_rows
from kvtrace.commands.common import open_database
from kvtrace.errors import QueryParameterError


def add_arguments(p) -> None:
    p.description = "Run a saved query by name. `kvtrace query --list` shows them all."
    p.add_argument("name", nargs="?", help="saved query name (see --list)")
    p.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE",
                   help="bind a query parameter (repeatable)")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.add_argument("--list", action="store_true", help="list saved queries with their parameters")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.list or not args.name:
        for name in queries.names():
            q = queries.load(name)
            params = ", ".join(f"{p.name}:{p.type}" + (f"={p.default}" if p.default is not None else "")
                               for p in q.params)
            print(f"{name}({params})\n    {q.summary}")
        return 0
    values = {}
    for item in args.param:
        if "=" not in item:
            raise QueryParameterError(f"--param {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        values[key.strip()] = value
    saved = queries.load(args.name)
    saved.bind(values)  # fail on bad parameters before touching the database
    client = open_database(args)
    columns, rows = queries.run(client, args.name, values)
    print_rows(columns, rows, args.format)
    return 0
