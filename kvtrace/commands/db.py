"""``kvtrace db init | ingest | status``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvtrace.collectors.ingest import IngestReport, ingest_paths, pending_files
from kvtrace.collectors.quarantine import quarantined_lines
from kvtrace.collectors.span_files import find_files, passed_over_message
from kvtrace.collectors.schema import SPAN_TABLES, TABLES, init_schema, latest_version, render_ddl, schema_version
from kvtrace.commands.common import open_database, progress_printer
from kvtrace.config import default_database_url, default_spool_dir
from kvtrace.db import connect, describe
from kvtrace.errors import IngestStopped
from kvtrace.recording.stats import COUNTERS, lost, read_stats, span_totals

STATUS_LISTED = 10
"""Pending files, quarantined lines and unreadable entries `db status` names before it counts the rest."""


def add_arguments(p) -> None:
    dbsub = p.add_subparsers(dest="db_command", metavar="ACTION")
    dbsub.required = True

    init = dbsub.add_parser("init", help="create otel_traces and the kvtrace tables and views, or upgrade them "
                                         "to this version's schema (idempotent)")
    init.add_argument("--cluster", metavar="NAME",
                      help="create every object ON CLUSTER NAME: replicated local tables behind Distributed ones")
    init.add_argument("--database", metavar="NAME", help="database to create the objects in (default: the URL's)")
    init.add_argument("--print", action="store_true", help="print the DDL of a new database instead of running it")
    init.set_defaults(func=run_init)

    ingest = dbsub.add_parser(
        "ingest", help="load spool / OTLP-JSON span files into ClickHouse",
        description="Store every span of the files once; lines that cannot be stored are quarantined (FILE:LINE "
                    "and why; see `db status`). In a directory only regular files are read: links, FIFOs and "
                    "devices are passed over and named. Exit 0: done, or nothing to ingest (no spool yet, or an "
                    "empty one); 1: a file could not be read, or the database stopped accepting spans (what was "
                    "stored is kept; run again to go on); 2: a path that is not a span file or a directory "
                    "(missing, /dev/null, a FIFO).")
    ingest.add_argument("paths", nargs="*", type=Path,
                        help="spool files or directories (default: the spool directory)")
    ingest.add_argument("--format", choices=("text", "json"), default="text")
    ingest.set_defaults(func=run_ingest)

    status = dbsub.add_parser("status", help="database, schema version, tables, row counts, pending spool files, "
                                             "drop counters")
    status.add_argument("--format", choices=("text", "json"), default="text")
    status.set_defaults(func=run_status)


def run_init(args) -> int:
    if args.print:
        for statement in render_ddl(args.database or "default", args.cluster):
            print(statement + ";\n")
        return 0
    url = default_database_url()
    client = connect(url)
    change = init_schema(client, database=args.database, cluster=args.cluster)
    if change.applied:
        done = f"upgraded from schema version {change.version_before}: {', '.join(change.applied)}"
    elif change.version_before == 0:
        done = f"created at schema version {change.version}"
    else:
        done = f"schema version {change.version}, nothing to upgrade"
    print(f"kvtrace: schema ready in {describe(url)} ({done})")
    return 0


def run_ingest(args) -> int:
    spool = default_spool_dir()
    if not args.paths and not os.path.lexists(spool):
        return _nothing_to_ingest(args, f"the spool {spool} does not exist yet: nothing has been recorded")
    paths = args.paths or [spool]
    passed_over: list[str] = []
    # A path that cannot be ingested is refused before the database is opened.
    if not find_files(paths, passed_over):
        if passed_over:
            _print_warnings(args, [passed_over_message(passed_over)])
        return _nothing_to_ingest(args, f"no span files in {', '.join(map(str, paths))}")
    client = open_database(args, ingest=False)
    try:
        report = ingest_paths(client, paths, progress=progress_printer(args))
    except IngestStopped as exc:
        _print_warnings(args, exc.report.messages if exc.report else [])
        stored = exc.report.spans if exc.report else 0
        raise IngestStopped(f"ingest stopped: {exc}. Everything stored is kept ({stored} span(s) by this run); "
                            "free space (or fix the database) and run `kvtrace db ingest` again: it goes on "
                            "where it stopped") from None
    _print_warnings(args, report.messages)
    if args.format == "json":
        print(json.dumps(_ingest_json(report), indent=2))
    else:
        repaired = f"; {report.repaired} value(s) left out of their spans" if report.repaired else ""
        print(f"kvtrace: ingested {report.spans} spans from {len(report.files)} file(s); "
              f"{report.duplicates} already stored; {report.quarantined} line(s) quarantined; "
              f"{report.pending_bytes} byte(s) still being written{repaired}")
    return 1 if any(f.unreadable for f in report.files) else 0


def _ingest_json(report: IngestReport) -> dict:
    return {"files": len(report.files), "spans": report.spans, "duplicates": report.duplicates,
            "quarantined": report.quarantined, "repaired": report.repaired, "pending_bytes": report.pending_bytes,
            "passed_over": report.passed_over, "per_file": [f.__dict__ for f in report.files]}


def _nothing_to_ingest(args, why: str) -> int:
    if args.format == "json":
        print(json.dumps({**_ingest_json(IngestReport()), "nothing_to_ingest": why}, indent=2))
    else:
        print(f"kvtrace: nothing to ingest: {why}")
    return 0


def _print_warnings(args, messages: list[str]) -> None:
    if sys.stderr.isatty() and not args.quiet:
        sys.stderr.write("\n")
    for message in messages:
        print(f"kvtrace: warning: {message}", file=sys.stderr)


def run_status(args) -> int:
    client = open_database(args, ingest=False)
    counts = {}
    for table in TABLES:  # a span stored twice (two paths, a retried write) is one row, as queries see it
        final = " FINAL" if table in SPAN_TABLES else ""
        counts[table] = int(client.query(f"SELECT count() FROM {table}{final}").result_rows[0][0])
    spool = default_spool_dir()
    unreadable: list[str] = []  # what could not be read is named; everything else is still shown
    pending = pending_files(spool, client, unreadable)
    stats = read_stats(spool, unreadable)
    totals = span_totals(stats)
    quarantined = quarantined_lines(spool / "quarantine", unreadable)
    status = {
        "database": describe(default_database_url()),
        "schema_version": schema_version(client),
        "tables": counts,
        "spool_dir": str(spool),
        "pending_files": [{"path": str(p), "bytes": n} for p, n in pending],
        "span_counters": totals,
        "processes": stats,
        "quarantined_lines": quarantined,
        "unreadable": unreadable,
    }
    if args.format == "json":
        print(json.dumps(status, indent=2))
        return 0
    print(f"database:    {status['database']}")
    newer = status["schema_version"] > latest_version()
    print(f"schema:      version {status['schema_version']}"
          + (f" (newer than this kvtrace, which knows up to {latest_version()})" if newer else ""))
    for table, n in counts.items():
        print(f"  {table:<26} {n:>12,} rows")
    print(f"spool:       {spool}  ({len(pending)} file(s) with {sum(n for _, n in pending):,} bytes pending)")
    for p, n in pending[:STATUS_LISTED]:
        print(f"  {p.name}  {n:,} bytes")
    print("span counters (all processes that wrote to this spool):")
    for k in COUNTERS:
        print(f"  {k:<26} {totals.get(k, 0):>12,}")
    print(f"quarantined: {len(quarantined)} line(s) in {spool / 'quarantine'}")
    for q in quarantined[:STATUS_LISTED]:
        print(f"  {q['file']}:{q['line']}: {q['error'][:160]}")
    if len(quarantined) > STATUS_LISTED:
        print(f"  ... and {len(quarantined) - STATUS_LISTED} more")
    if lost(totals):
        print(f"warning: {lost(totals)} span(s) could not be delivered (see counters above)")
    if totals.get("recorder_failures"):
        print(f"warning: {totals['recorder_failures']} process(es) ran untraced: their recorder could not be created")
    if totals.get("hooks_missing"):
        print(f"warning: {totals['hooks_missing']} hook target(s) missing in the engine: the engine's log names each "
              "and the feature it turned off")
    if unreadable:
        print(f"not read: {len(unreadable)} thing(s) in the spool (the figures above leave them out)")
        for problem in unreadable[:STATUS_LISTED]:
            print(f"  {problem}")
        if len(unreadable) > STATUS_LISTED:
            print(f"  ... and {len(unreadable) - STATUS_LISTED} more")
    return 0
