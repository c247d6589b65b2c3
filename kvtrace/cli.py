"""The ``kvtrace`` command line.

Each sub-command lives in ``kvtrace/commands/<name>.py`` and exposes
``register(subparsers)`` which adds its parser and sets ``func`` (a callable
taking the parsed args and returning an exit code).  Exit codes: 0 success,
1 runtime failure (database, run not found...), 2 usage or configuration
error.  Errors go to stderr as one line, ``kvtrace: error: ...``; ``--debug``
(or ``KVTRACE_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import Optional

from kvtrace import __version__
from kvtrace.error_report import one_line, traceback_requested
from kvtrace.errors import KvtraceError

COMMAND_MODULES = [
    "kvtrace.commands.db",
    "kvtrace.commands.query",
    "kvtrace.commands.selfcheck",
    "kvtrace.commands.make_model",
    "kvtrace.commands.run",
    "kvtrace.commands.diff",
    "kvtrace.commands.runs",
    "kvtrace.commands.experiment",
    "kvtrace.commands.replay",
    "kvtrace.commands.advise",
    "kvtrace.commands.demo",
    "kvtrace.commands.alert",
    "kvtrace.commands.probe",
    "kvtrace.commands.import_logs",
    "kvtrace.commands.proxy",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrace",
        description="Trace cache provenance and token margins inside LLM engines; find why two runs forked.",
    )
    parser.add_argument("--version", action="version", version=f"kvtrace {__version__}")
    parser.add_argument(
        "--db",
        metavar="URL",
        default=None,
        help="ClickHouse to use: chdb:///path (embedded, default: per-user data dir), "
        "chdb://memory, or http(s)://user:password@host:port/database "
        "(env KVTRACE_CLICKHOUSE_URL)",
    )
    parser.add_argument(
        "--spool-dir",
        metavar="DIR",
        default=None,
        help="spool directory engines write to (env KVTRACE_SPOOL_DIR)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debugging detail")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of one line (env KVTRACE_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if exc.name == name:
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(levelname)s: %(message)s")
    if args.db:
        os.environ["KVTRACE_CLICKHOUSE_URL"] = args.db
    if args.spool_dir:
        os.environ["KVTRACE_SPOOL_DIR"] = args.spool_dir
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KvtraceError as exc:
        if traceback_requested(args):
            traceback.print_exc()
        print(f"kvtrace: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kvtrace: interrupted; everything recorded so far is kept", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # not foreseen: still one line (and a runtime failure), the traceback on request
        if traceback_requested(args):
            traceback.print_exc()
        print(f"kvtrace: error: {one_line(exc)} (--debug or KVTRACE_DEBUG=1 shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
