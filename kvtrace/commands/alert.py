"""``kvtrace alert --rules FILE``: evaluate alert rules once (or ``--watch``), deliver what fires.

Exit codes (one evaluation): 0 all clear, 1 an alert is firing, 2 the rules
could not be evaluated (rules file invalid, database unreachable, a rule's
query failed) — with a message saying which.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

from kvtrace.alerts import cycle as alert_cycle
from kvtrace.alerts.delivery import Deliverer
from kvtrace.alerts.rules import load_rules
from kvtrace.alerts.state import AlertState, AlertStateError, default_state_path
from kvtrace.commands.alert_database import evaluate_database, evaluate_database_isolated
from kvtrace.config import default_database_url
from kvtrace.db import chdb_path
from kvtrace.error_report import one_line, traceback_requested
from kvtrace.errors import ConfigError, KvtraceError


def add_arguments(p) -> None:
    p.description = ("Evaluate the rules of a YAML file over their time windows (saved queries margin_shift, "
                     "divergence_rates, near_tie_share), print firing alerts and deliver them to the configured "
                     "webhook / Alertmanager; cleared alerts are sent as resolved. Exit code: 0 all clear, "
                     "1 firing, 2 could not evaluate.")
    p.add_argument("--rules", required=True, type=Path, metavar="FILE", help="alert rules (YAML)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="evaluate every SECONDS until interrupted")
    p.add_argument("--cycles", type=int, metavar="N", help="with --watch: stop after N evaluations")
    p.add_argument("--at", metavar="TIME", help="evaluate the windows ending at TIME (epoch seconds or ISO 8601) "
                                                "instead of now; not with --watch")
    p.add_argument("--state", type=Path, metavar="FILE",
                   help="where firing alerts are remembered between runs (default: in the data dir, per rules file)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Exit 1 means "firing" to whoever runs this from cron: nothing else may end with 1."""
    try:
        return evaluate_and_deliver(args)
    except KvtraceError as exc:
        print(f"kvtrace: error: could not evaluate: {exc}", file=sys.stderr)
    except Exception as exc:
        if traceback_requested(args):
            traceback.print_exc()
        print(f"kvtrace: error: could not evaluate: {one_line(exc)}", file=sys.stderr)
    return 2


def evaluate_and_deliver(args) -> int:
    if args.watch is not None and (not 0 < args.watch < math.inf or args.at):
        raise ConfigError("--watch needs a positive number of seconds and cannot be combined with --at")
    if args.cycles is not None and (args.cycles < 1 or args.watch is None):
        raise ConfigError("--cycles needs --watch and a whole number >= 1")
    at = parse_time(args.at) if args.at else None
    config = load_rules(args.rules)
    state = AlertState.load(args.state or default_state_path(args.rules))
    deliverer = Deliverer(config.delivery)
    if args.watch is None:
        return cycle(args, config, state, deliverer, at if at is not None else time.time())
    code, done = 0, 0
    while True:
        started = time.monotonic()
        code = cycle(args, config, state, deliverer, time.time())
        done += 1
        if args.cycles and done >= args.cycles:
            return code
        time.sleep(max(0.0, args.watch - (time.monotonic() - started)))


def cycle(args, config, state, deliverer, at: float) -> int:
    """One evaluation with delivery and printing; never raises for database, delivery or state-file trouble."""
    if args.watch is not None and chdb_path(default_database_url()):
        evaluation = evaluate_database_isolated(args, config, at)  # chDB leaks descriptors per open/close
    else:
        evaluation = evaluate_database(args, config, at)
    report = alert_cycle.apply(state, evaluation, config)
    alert_cycle.deliver(state, report, config, deliverer)
    print_report(report)
    try:
        state.save()
    except AlertStateError as exc:
        print(f"kvtrace: error: could not evaluate: {exc}", file=sys.stderr)
        return 2
    return report.exit_code


SHOWN_RULE_NAMES = 5
"""Rules named in the line of an error that many share."""


def print_report(report) -> None:
    evaluation = report.evaluation
    stamp = datetime.fromtimestamp(evaluation.at).isoformat(timespec="seconds")
    for alert in evaluation.firing:
        print(f"{stamp} FIRING   {alert.rule}: {alert.annotations['summary']} "
              f"[{alert.samples} samples]", flush=True)
    for tracked in report.resolved:
        print(f"{stamp} RESOLVED {tracked.rule}: {tracked.annotations.get('summary', '')}", flush=True)
    by_error: dict[str, list[str]] = {}
    for outcome in evaluation.failed:
        by_error.setdefault(outcome.error, []).append(outcome.rule.name)
    for error, names in by_error.items():  # one line per reason: an unreachable database fails every rule
        shown = ", ".join(names[:SHOWN_RULE_NAMES]) + (f" and {len(names) - SHOWN_RULE_NAMES} more"
                                                       if len(names) > SHOWN_RULE_NAMES else "")
        print(f"kvtrace: error: could not evaluate rule{'s' if len(names) > 1 else ''} {shown}: {error}",
              file=sys.stderr)
    for message in report.delivery_errors:
        print(f"kvtrace: warning: {message}", file=sys.stderr)
    if not evaluation.firing and not evaluation.failed:
        judged = sum(o.rows for o in evaluation.outcomes)
        print(f"{stamp} all clear: {len(evaluation.outcomes)} rule(s), {judged} measurement(s) with enough samples",
              flush=True)


def parse_time(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError):
            seconds = math.nan
    try:
        datetime.fromtimestamp(seconds)  # also the range the windows are printed and sent in
    except (ValueError, OverflowError, OSError):
        raise ConfigError(f"--at {text!r}: give epoch seconds or an ISO 8601 time") from None
    return seconds
