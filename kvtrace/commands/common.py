"""What several commands share: opening the database, progress, output formats."""

from __future__ import annotations

import sys

from kvtrace import progress
from kvtrace.config import default_database_url, default_spool_dir
from kvtrace.errors import SchemaMissing
from kvtrace.progress import Progress


def progress_printer(args) -> Progress:
    """Progress on stderr: a bar on a terminal, a log line every few seconds otherwise, none with --quiet."""
    return progress.for_stderr(quiet=getattr(args, "quiet", False))


def open_database(args, ingest: bool = True):
    """Connect, make sure the schema exists at the latest version, and take in pending spool files first.

    The embedded database gets its schema created on first use; a server must
    be initialised explicitly with ``kvtrace db init`` (creating tables on a
    shared server is the operator's decision).  Either is upgraded here when
    this kvtrace knows a newer schema version than the database has.
    """
    from kvtrace.collectors.schema import init_schema, latest_version, schema_state
    from kvtrace.db import connect

    url = default_database_url()
    client = connect(url)
    version, missing = schema_state(client)
    if version == 0 and not url.startswith("chdb:"):
        raise SchemaMissing(f"{url} has no kvtrace tables yet; run `kvtrace --db URL db init` first")
    if version < latest_version() or missing:
        init_schema(client)
    if ingest:
        spool = default_spool_dir()
        if spool.is_dir():
            from kvtrace.collectors.ingest import ingest_paths

            report = ingest_paths(client, [spool], progress=progress_printer(args))
            if report.quarantined:
                for f in report.files:
                    for message in f.messages:
                        print(f"kvtrace: warning: {message}", file=sys.stderr)
    return client


