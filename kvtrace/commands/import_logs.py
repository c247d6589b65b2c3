"""``kvtrace import FILE...``: recorded OpenAI-compatible request/response logs → kvtrace runs.

(The module is not called ``import``: that is a Python keyword.)
"""

from __future__ import annotations

import sys

from kvtrace.commands.arguments import input_file
from kvtrace.commands.common import open_database
from kvtrace.exchanges.importer import PROBLEMS_KEPT, ImportOptions, import_files


def add_arguments(p) -> None:
    p.description = ("Each line: {\"episode_id\": ..., \"request_index\": N, \"request\": {...}, \"response\": "
                     "{...}} with logprobs (top_logprobs >= 2 for margins); optional run_id, arm, timestamp. "
                     "Imported requests become kvtrace spans, so `kvtrace diff` finds where two logged runs forked. "
                     f"Malformed lines are reported with their line number (the first {PROBLEMS_KEPT}, then a "
                     "count); the rest is imported.")
    p.add_argument("files", nargs="+", type=input_file, metavar="FILE")
    p.add_argument("--run-id", metavar="RUN", help="run id for lines without one (default: the file name's stem)")
    p.add_argument("--engine", default="openai-compatible",
                   help="engine label of the server that answered (e.g. vllm, llama-server)")
    p.add_argument("--weight-format", default="", metavar="FMT", help="weight format label (e.g. Q4_K_M)")
    p.add_argument("--arm", default="", help="arm label for lines without one")
    p.add_argument("--no-ingest", action="store_true", help="only write the spool; do not load it into the database")
    p.set_defaults(func=run)


def run(args) -> int:
    options = ImportOptions(run_id=args.run_id or "", engine=args.engine, weight_format=args.weight_format,
                            arm=args.arm)
    report = import_files(args.files, options)
    for problem in report.problems:
        print(f"kvtrace: error: {problem}", file=sys.stderr)
    if report.rejected > len(report.problems):
        print(f"kvtrace: error: ... and {report.rejected - len(report.problems):,} more line(s) rejected "
              f"(the first {len(report.problems)} are shown)", file=sys.stderr)
    runs = ", ".join(f"{run} ({count})" for run, count in sorted(report.runs.items())) or "none"
    print(f"kvtrace: imported {report.imported} request(s) into run(s) {runs}; "
          f"{report.rejected} line(s) rejected", file=sys.stderr)
    if not args.no_ingest and report.imported:
        open_database(args).close()  # takes in the spool just written
    return 1 if report.rejected else 0
