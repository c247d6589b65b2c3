"""The database part of one alert evaluation: open the database, evaluate every rule, close it.

``kvtrace alert --watch`` opens and closes the database every cycle, so that
other kvtrace commands can use an embedded database (one process's at a
time) between cycles.  chDB does not give back every thread and file
descriptor it opened when it closes, so a watch that opened it in its own
process would run out of descriptors after some hours.  With an embedded
database each watch cycle's database part therefore runs in a short-lived
child (``python -m kvtrace.commands.alert_database``) that hands the
evaluation back and exits; its end — a crash, a hang past
``ISOLATED_TIMEOUT_S`` — becomes an error for every rule of that cycle.

Child protocol: the pickled ``(args, config, at)`` on stdin; the pickled
:class:`Evaluation` on the descriptor that was its stdout (which it points at
stderr first, so nothing chDB prints can end up inside the answer).  Both
ends are this kvtrace, so pickle is safe here.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import traceback

from kvtrace.alerts.evaluation import Evaluation, RuleOutcome, evaluate
from kvtrace.alerts.rules import AlertConfig
from kvtrace.child_python import python_module_command
from kvtrace.commands.common import open_database
from kvtrace.error_report import one_line, traceback_requested
from kvtrace.errors import KvtraceError

ISOLATED_TIMEOUT_S = 600.0
"""How long one cycle's child may take (spool ingest included) before it is killed."""


def evaluate_database(args, config: AlertConfig, at: float) -> Evaluation:
    """Open, evaluate, close, in this process.  Never raises: what fails is every rule's error."""
    client = None
    try:
        client = open_database(args)
        return evaluate(client, config, at)
    except Exception as exc:  # unreachable database, an ingest that failed: no rule was evaluated
        if traceback_requested(args) and not isinstance(exc, KvtraceError):
            traceback.print_exc()
        return failed(config, at, str(exc) if isinstance(exc, KvtraceError) else one_line(exc))
    finally:
        if client is not None:
            client.close()  # the embedded database is one process's at a time: free it between cycles


def evaluate_database_isolated(args, config: AlertConfig, at: float) -> Evaluation:
    """:func:`evaluate_database` in a short-lived child process.  Never raises."""
    try:
        child = subprocess.run(python_module_command(__name__), input=pickle.dumps((args, config, at)),
                               stdout=subprocess.PIPE, timeout=ISOLATED_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        return failed(config, at, f"the evaluation process did not finish within {ISOLATED_TIMEOUT_S:g} s")
    except OSError as exc:  # no process could be started (out of processes or memory)
        return failed(config, at, f"the evaluation process could not start: {exc.strerror or exc}")
    if child.returncode < 0:
        return failed(config, at, f"the evaluation process died with {_signal_name(-child.returncode)}")
    try:
        evaluation = pickle.loads(child.stdout)
    except Exception:
        evaluation = None
    if child.returncode != 0 or not isinstance(evaluation, Evaluation):
        return failed(config, at, f"the evaluation process exited with status {child.returncode} "
                                  "without an answer (its error is above)")
    return evaluation


def failed(config: AlertConfig, at: float, reason: str) -> Evaluation:
    return Evaluation(at, [RuleOutcome(rule, error=reason) for rule in config.rules])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the watching parent, which then ends this process
    answer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever is printed from here on (Python or chDB) goes to stderr, not into the answer
    sys.stdout = sys.stderr
    args, config, at = pickle.load(sys.stdin.buffer)
    evaluation = evaluate_database(args, config, at)
    with answer:
        pickle.dump(evaluation, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
