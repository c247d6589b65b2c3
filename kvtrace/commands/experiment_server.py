"""``kvtrace experiment --server COMMAND|URL``: the experiment against llama-server (kept apart from
``experiment.py``, which runs it in-process; both print the same report)."""

from __future__ import annotations

import dataclasses
import json
import sys

from kvtrace.errors import EngineFailed


def run_against_server(args) -> int:
    from kvtrace.commands.common import open_database, progress_printer
    from kvtrace.commands.experiment import plan_from_args, write_plot_or_say_why
    from kvtrace.experiment import server
    from kvtrace.experiment.report import build_report, print_report

    command, url = server.parse_target(args.server)
    if args.arms == ("off", "reuse", "prompt-cache") and url is not None:
        args.arms = ("off", "reuse")  # the default arms a running server can offer
    progress = progress_printer(args)
    progress("asking the server for its model's weight format")
    args.formats = (server.detect_format(command, url, args.n_ctx),)
    plan = plan_from_args(args)
    server.check_arms(plan, url)
    outcome = server.run_server_experiment(plan, command, url, progress)
    progress("ingesting")
    client = open_database(args)
    progress("")
    if outcome.failure is not None:
        raise EngineFailed(outcome.failure.describe())
    report = build_report(client, dataclasses.replace(plan), outcome)
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_report(report, sys.stdout)
    if args.plot:
        write_plot_or_say_why(report, args.plot)
    return 130 if outcome.interrupted else 0
