"""What several commands share: opening the database, progress, output formats, the pass time-out option."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional, TextIO

from kvtrace import progress
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.schema import init_schema, latest_version, schema_state
from kvtrace.commands.arguments import positive_number
from kvtrace.config import default_database_url, default_spool_dir
from kvtrace.db import connect, describe
from kvtrace.errors import KvtraceError, SchemaMissing
from kvtrace.progress import BarProgress, Progress


def progress_printer(args) -> Progress:
    """Progress on stderr: a bar on a terminal, a log line every few seconds otherwise, none with --quiet."""
    return progress.for_stderr(quiet=getattr(args, "quiet", False))


def add_pass_timeout_option(parser, default: float) -> None:
    """experiment, advise and demo run each engine pass in its own process, watched for stalls."""
    parser.add_argument("--pass-timeout", type=positive_number, default=default, metavar="SECONDS",
                        help="end the command when one request (or model load) of a pass takes longer than "
                             "this: the engine hangs (default %(default)g)")


def open_database_after_passes(args, progress: Progress):
    """After a run's passes: the database, with the spool they wrote ingested."""
    progress("ingesting")
    client = open_database(args)
    progress("")
    return client


def write_report(report: dict, as_json: bool, print_text: Callable[[dict, TextIO], None], plot_path: Optional[Path],
                 write_plot: Callable[[dict, Path], Optional[Path]], nothing_to_plot: str) -> None:
    """A report (experiment, advise) on stdout as JSON or text, and its plot where a path is given."""
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(report, sys.stdout)
    if plot_path:
        written = write_plot(report, plot_path)
        print(f"kvtrace: wrote {written}" if written else f"kvtrace: no plot written: {nothing_to_plot}",
              file=sys.stderr)


def open_database(args, ingest: bool = True):
    """Connect, make sure the schema exists at the latest version, and take in pending spool files first.

    The embedded database gets its schema created on first use; a server must
    be initialised explicitly with ``kvtrace db init`` (creating tables on a
    shared server is the operator's decision).  Either is upgraded here when
    this kvtrace knows a newer schema version than the database has.
    """
    url = default_database_url()
    client = connect(url)
    version, missing = schema_state(client)
    if version == 0 and not url.startswith("chdb:"):
        raise SchemaMissing(f"{describe(url)} has no kvtrace tables yet; run `kvtrace --db URL db init` first")
    if version < latest_version() or missing:
        init_schema(client)
    if ingest:
        _ingest_spool(args, client)
    return client


QUERY_SIDE_WARNINGS = 5
"""Ingest warnings a query command prints before pointing at ``kvtrace db status``."""


def _ingest_spool(args, client) -> None:
    """Take in the spool before a query.  Whatever goes wrong here is a warning: the query still runs."""
    spool = default_spool_dir()
    shown = progress_printer(args)
    try:
        if not spool.is_dir():
            return
        report = ingest_paths(client, [spool], progress=shown)
    except KvtraceError as exc:  # unreadable spool, or a database that stopped accepting spans
        report = getattr(exc, "report", None)
        messages = (report.messages if report else [])[:QUERY_SIDE_WARNINGS]
        messages.append(f"spool not (fully) ingested: {exc}; the query uses what is stored")
    except OSError as exc:
        messages = [f"spool {spool} not ingested: {exc.strerror or exc}; the query uses what is stored"]
    else:
        messages = report.messages
    if messages and isinstance(shown, BarProgress):
        sys.stderr.write("\r\033[K")  # clear the progress line
    for message in messages[:QUERY_SIDE_WARNINGS]:
        print(f"kvtrace: warning: {message}", file=sys.stderr)
    if len(messages) > QUERY_SIDE_WARNINGS:
        print(f"kvtrace: warning: ... and {len(messages) - QUERY_SIDE_WARNINGS} more; `kvtrace db status` "
              "lists what is quarantined", file=sys.stderr)
