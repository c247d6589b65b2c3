"""What a user reads back about cache integrity once a run's spans are in the database.

Every engine's integrity test ends the same way: the spool goes through ``kvtrace ingest``, then
``kvtrace runs`` counts the violations per run and an alert rule on ``integrity_violations`` fires
(or stays quiet) for the runs whose id starts with a prefix.
"""

from __future__ import annotations

import time

from kvtrace import queries
from kvtrace.alerts.evaluation import evaluate
from kvtrace.alerts.rules import parse_config
from kvtrace.collectors.ingest import ingest_paths


def store(recorder, spool_dir, db) -> None:
    """The recorder's spans flushed to its spool and ingested into ``db``, none lost to an error."""
    recorder.pipeline.force_flush()
    ingest_paths(db, [spool_dir])
    errors = recorder.pipeline.counters["instrumentation_errors"]
    assert errors == 0, f"{errors} instrumentation errors"


def assert_counted_and_alerted(db, faulted: str, honest: str, engine: str) -> None:
    """``kvtrace runs`` counts one violation for the faulted run and none for the honest one; a rule on
    the ``integrity_violations`` metric fires for the faulted run only, labelled with its engine, while
    the honest run's rule finds its requests that reused state and stays quiet; an hour on, out of
    the window, nothing fires."""
    columns, rows = queries.run(db, "runs")
    counts = {row[columns.index("run_id")]: row[columns.index("integrity_violations")] for row in rows}
    assert counts == {faulted: 1, honest: 0}, f"kvtrace runs counts {counts}"

    now = time.time()
    fired, quiet = _alert_per_run(db, now, (faulted, honest))
    assert [(a.value, a.labels["alertname"], a.labels["engine"]) for a in fired.firing] == [
        (1, f"violations-{faulted}", engine)], f"fired: {fired}"
    assert quiet.firing == [] and quiet.rows == 1 and not quiet.error, f"honest run's rule: {quiet}"
    (late,) = _alert_per_run(db, now + 7200, (faulted,))
    assert late.firing == [], f"out of the window: {late}"


def _alert_per_run(db, now: float, runs: tuple[str, ...]):
    """One rule per run (``violations-<run>``: any violation in the last hour), evaluated at ``now``:
    their outcomes, in the order of ``runs``."""
    rules = [{"name": f"violations-{run}", "metric": "integrity_violations", "threshold": 0, "window": "1h",
              "run_prefix": run} for run in runs]
    return evaluate(db, parse_config({"rules": rules}), now).outcomes
