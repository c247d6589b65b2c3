"""Run ingest in this process and SIGKILL it right after its Nth write (a test helper, run as a script).

    python ingest_until_killed.py DB_PATH QUARANTINE_DIR CHUNK_BYTES KILL_AT PATH...

Every write ingest makes to persistent state is a step: each INSERT (spans or a progress record) and
each quarantine copy.  (A kill between two writes leaves the state of a kill right after the first.)
Step KILL_AT ends the process with SIGKILL as soon as the call returns (0: never), so no Python
cleanup runs.  Each step is printed first as
``step N: what`` so the test can name the step it killed at.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from kvtrace.collectors import ingest, quarantine
from kvtrace.collectors.schema import init_schema
from kvtrace.db import connect


def main() -> None:
    db_path, quarantine_dir, chunk_bytes, kill_at, *paths = sys.argv[1:]
    ingest.CHUNK_BYTES = int(chunk_bytes)
    kill_at = int(kill_at)
    steps = [0]

    def step(what: str) -> None:
        steps[0] += 1
        print(f"step {steps[0]}: {what}", flush=True)
        if steps[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    client = connect(f"chdb://{db_path}")
    init_schema(client)
    for method in ("insert", "insert_arrow"):  # rows (progress records, line hashes) and Arrow columns (spans)
        def insert(table, *args, _real=getattr(client, method), **kwargs):
            result = _real(table, *args, **kwargs)
            step(f"after INSERT into {table}")
            return result

        setattr(client, method, insert)
    real_add = quarantine.Quarantine.add

    def add(self, *args, **kwargs):
        where = real_add(self, *args, **kwargs)
        step("after a quarantine copy")
        return where

    quarantine.Quarantine.add = add
    report = ingest.ingest_paths(client, [Path(p) for p in paths], quarantine_dir=Path(quarantine_dir))
    for message in report.messages:
        print(f"message: {message}", flush=True)
    print(f"done: {report.spans} spans, {report.quarantined} quarantined, {steps[0]} steps", flush=True)
    client.close()


if __name__ == "__main__":
    main()
