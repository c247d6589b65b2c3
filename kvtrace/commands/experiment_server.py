"""``kvtrace experiment --server COMMAND|URL``: the experiment against llama-server (kept apart from
``experiment.py``, which runs it in-process; both print the same report)."""

from __future__ import annotations

from kvtrace.commands.common import progress_printer
from kvtrace.commands.experiment import plan_from_args, report_outcome, require_plot_extra
from kvtrace.errors import ConfigError
from kvtrace.experiment import server
from kvtrace.testmodels.llama_gguf import QUANTS


def run_against_server(args) -> int:
    command, url = server.parse_target(args.server)
    if args.plot:
        require_plot_extra()
    if url is not None and args.arms is None:
        args.arms = ("off", "reuse")  # the default arms a running server can offer
    plan = plan_from_args(args)  # checked before the server is asked anything
    server.check_plan(plan, url)
    progress = progress_printer(args)
    progress("asking the server for its model's weight format")
    detected = server.detect_format(command, url, plan)
    if detected not in QUANTS:
        raise ConfigError(f"the server's model is {detected}; the experiment compares the formats {', '.join(QUANTS)}")
    args.formats = (detected,)
    plan = plan_from_args(args)
    outcome = server.run_server_experiment(plan, command, url, progress)
    return report_outcome(args, plan, outcome, progress)
