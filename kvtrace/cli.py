"""The ``kvtrace`` command line.

Each sub-command lives in ``kvtrace/commands/<name>.py``, which defines
``add_arguments(parser)``: its description and arguments, and ``func`` (a
callable taking the parsed args and returning an exit code) through
``parser.set_defaults``.  ``COMMANDS`` below names every command with its
module and its one-line help, so ``kvtrace --help`` lists them without
importing any, and a command line imports only the module of the command it
chose: ``kvtrace diff ...`` never loads what ``kvtrace experiment`` needs.
A new command is one line in ``COMMANDS`` and its module. The shared options
(``--db``, ``--spool-dir``, ``-q``...) are taken before the command or after it.

Exit codes: 0 success, 1 runtime failure (database, run not found...), 2
usage or configuration error.  Errors go to stderr as one line, ``kvtrace:
error: ...``; ``--debug`` (or ``KVTRACE_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import NamedTuple, Optional

from kvtrace import __version__
from kvtrace.error_report import one_line, traceback_requested
from kvtrace.errors import KvtraceError


class Command(NamedTuple):
    module: str
    summary: str
    """The line ``kvtrace --help`` shows for it."""


COMMANDS: dict[str, Command] = {
    "db": Command("kvtrace.commands.db", "create the ClickHouse schema, ingest spool files, show status"),
    "query": Command("kvtrace.commands.query", "run a saved query from queries/ by name"),
    "selfcheck": Command("kvtrace.commands.selfcheck",
                         "record synthetic spans, ingest them and read them back (no engine needed)"),
    "make-model": Command("kvtrace.commands.make_model",
                          "write a random-weight Llama-architecture GGUF (fixed seed, built-in tokenizer)"),
    "run": Command("kvtrace.commands.run",
                   "run a command (e.g. python -m llama_cpp.server ...) with kvtrace instrumentation"),
    "diff": Command("kvtrace.commands.diff", "where two runs of the same episodes forked, and why"),
    "runs": Command("kvtrace.commands.runs", "list runs with their configuration and counts"),
    "experiment": Command("kvtrace.commands.experiment", "measure how often cache arms fork a multi-turn workload"),
    "replay": Command("kvtrace.commands.replay",
                      "re-execute a run's episode on its recorded cache paths; prove a fork's cause"),
    "advise": Command("kvtrace.commands.advise",
                      "find the cheapest llama.cpp setting under which caching forks nothing"),
    "demo": Command("kvtrace.commands.demo", "generate a test model, make two cache arms fork, and explain one fork"),
    "alert": Command("kvtrace.commands.alert", "evaluate alert rules on margin shift, divergence and near ties"),
    "probe": Command("kvtrace.commands.probe",
                     "probe a running OpenAI-compatible server: cold vs warm requests as spans"),
    "import": Command("kvtrace.commands.import_logs",
                      "import OpenAI-compatible request/response logs (JSON lines) as runs"),
    "proxy": Command("kvtrace.commands.proxy",
                     "a reverse proxy that records every completion request to an OpenAI-compatible server"),
}


def build_parser(argv: Optional[list[str]] = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command listed, the arguments of the one ``argv`` chose added.

    A first pass over ``argv`` (the commands' parsers still empty) finds the
    command; only its module is imported, to add its arguments before the
    real parse.  Options before the command are the same in both passes, so
    a mistake there gets the same message and exit code 2 as always.
    """
    parser = argparse.ArgumentParser(
        prog="kvtrace",
        description="Trace cache provenance and token margins inside LLM engines; find why two runs forked.",
    )
    parser.add_argument("--version", action="version", version=f"kvtrace {__version__}")
    _add_shared_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # add_help=False: in the first pass a command's --help is one of its arguments still to come.
    parsers = {name: sub.add_parser(name, help=command.summary, add_help=False) for name, command in COMMANDS.items()}
    chosen = parser.parse_known_args(argv)[0].command
    if chosen:
        command_parser = parsers[chosen]
        command_parser.add_argument("-h", "--help", action="help", default=argparse.SUPPRESS,
                                    help="show this help message and exit")
        importlib.import_module(COMMANDS[chosen].module).add_arguments(command_parser)
        _add_after_command(command_parser)
    return parser


def _add_shared_options(parser, after_command: bool = False) -> None:
    """The options every command shares, before the command or after it. After it they are SUPPRESSed when
    left out, so what was given before the command stands."""
    default, flag = (argparse.SUPPRESS, argparse.SUPPRESS) if after_command else (None, False)
    parser.add_argument(
        "--db",
        metavar="URL",
        default=default,
        help="ClickHouse to use: chdb:///path (embedded, default: per-user data dir), "
        "chdb://memory, or http(s)://user:password@host:port/database "
        "(env KVTRACE_CLICKHOUSE_URL; a password on the command line is visible to every user in ps: "
        "give it in the environment or with --db-file)",
    )
    parser.add_argument(
        "--db-file",
        metavar="FILE",
        default=default,
        help="read the --db URL from FILE (env KVTRACE_CLICKHOUSE_URL_FILE)",
    )
    parser.add_argument(
        "--spool-dir",
        metavar="DIR",
        default=default,
        help="spool directory engines write to (env KVTRACE_SPOOL_DIR)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", default=flag, help="no progress output on stderr")
    parser.add_argument("-v", "--verbose", action="store_true", default=flag, help="log debugging detail")
    parser.add_argument("--debug", action="store_true", default=flag,
                        help="show the traceback of an error instead of one line (env KVTRACE_DEBUG=1)")


def _add_after_command(parser: argparse.ArgumentParser) -> None:
    """The shared options on a command's parser and on those of its own commands (``db status``)."""
    _add_shared_options(parser.add_argument_group("options also given before the command"), after_command=True)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command_parser in set(action.choices.values()):
                _add_after_command(command_parser)


LIBRARY_LOGGERS = ("urllib3", "clickhouse_connect", "chdb")
"""Libraries whose words (a retried connection, a driver error, chDB's own error text) kvtrace's one-line
message already says in its own: shown with --debug or --verbose only."""


def configure_logging(args) -> None:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(levelname)s: %(message)s")
    level = logging.DEBUG if (args.verbose or traceback_requested(args)) else logging.CRITICAL + 1
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure_logging(args)
    if args.db and args.db_file:
        print("kvtrace: error: give the database as --db URL or --db-file FILE, not both", file=sys.stderr)
        return 2
    if args.db:
        os.environ["KVTRACE_CLICKHOUSE_URL"] = args.db
    if args.db_file:
        os.environ.pop("KVTRACE_CLICKHOUSE_URL", None)  # the file given here wins over the environment
        os.environ["KVTRACE_CLICKHOUSE_URL_FILE"] = args.db_file
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
