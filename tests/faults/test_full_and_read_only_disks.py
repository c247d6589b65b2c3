"""The spool on a full or read-only disk: the host runs on, no torn record, every span spooled or counted.

The disks are real: a 2 MB tmpfs that fills up, and a tmpfs mounted
read-only (``chmod`` does not stop root). The counters are read where
``kvtrace db status`` reads them, which must work although the spool
directory itself takes no more writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sink_faults import (assert_every_span_accounted, counters_of, record_spans, spooled_spans, tmpfs)


def spool_lines(spool_dir):
    """Every line of every spool file, each checked to be a whole OTLP/JSON request."""
    lines = []
    for path in sorted(spool_dir.glob("*.jsonl")):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path.name} ends in a torn record"
        for number, line in enumerate(data.splitlines(), 1):
            try:
                lines.append(json.loads(line)["resourceSpans"])
            except (ValueError, KeyError):
                pytest.fail(f"{path.name}:{number} is not a whole record: {line[:80]!r}...")
    return lines


def test_a_spool_that_fills_up_keeps_whole_records_and_counts_what_did_not_fit(tmp_path, db):
    spool = tmp_path / "small-disk"
    with tmpfs(spool, "2m"):
        # About 4 MB of spans in batches of ~200 KB for a 2 MB disk: the batch that meets the end of the
        # disk is written in part before the write fails.
        host = record_spans(300, {"KVTRACE_SPOOL_DIR": str(spool), "KVTRACE_RUN_ID": "full-disk",
                                  "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}, tokens=256)
        lines = spool_lines(spool)
        counters = counters_of(spool)  # published on the full disk, in blocks allocated at start
        spooled = spooled_spans(db, spool, "full-disk")
    print(f"{len(lines)} whole lines spooled, counters: { {k: v for k, v in counters.items() if v} }")
    assert_every_span_accounted(300, counters, stored=0, spooled=spooled)
    assert counters["spans_failed_export"] > 0  # the disk really filled up
    # Once each time failures start: a small batch can still fit after a failure, and writing then
    # "works again" until the next failure starts a new spell, which is logged once more.
    failures, recoveries = len(host.warnings("No space left on device")), len(host.warnings("works again"))
    assert failures >= 1 and recoveries in (failures - 1, failures), host.stderr


def test_a_disk_full_from_the_start_still_publishes_counters_where_db_status_finds_them(tmp_path, db):
    spool = tmp_path / "full-disk"
    with tmpfs(spool, "1m"):
        with open(spool / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            except OSError:
                pass
        record_spans(50, {"KVTRACE_SPOOL_DIR": str(spool), "KVTRACE_RUN_ID": "full-from-start"})
        counters = counters_of(spool)
        assert not list((spool / "stats").glob("*.stats"))  # they could not go beside the spool...
        spooled = spooled_spans(db, spool, "full-from-start")
    assert_every_span_accounted(50, counters, stored=0, spooled=spooled)  # ...so they went to the data home
    assert spooled == 0 and counters["spans_failed_export"] == 50


def test_a_read_only_spool_dir_loses_spans_visibly_and_db_status_says_so(tmp_path, db):
    spool = tmp_path / "read-only"
    with tmpfs(spool, "1m", read_only=True):
        host = record_spans(40, {"KVTRACE_SPOOL_DIR": str(spool), "KVTRACE_RUN_ID": "read-only"})
        counters = counters_of(spool)
        assert_every_span_accounted(40, counters, stored=0, spooled=spooled_spans(db, spool, "read-only"))
        assert counters["spans_failed_export"] == 40
        assert len(host.warnings("Read-only file system")) >= 1, host.stderr
        # What a user runs: the real CLI in its own process, on its own database.
        status = subprocess.run([sys.executable, "-m", "kvtrace.cli", "--db", f"chdb://{tmp_path / 'status-db'}",
                                 "--spool-dir", str(spool), "db", "status"], capture_output=True, text=True,
                                timeout=120)
    assert status.returncode == 0, status.stderr
    assert "spans_failed_export" in status.stdout and "40 span(s) could not be delivered" in status.stdout


@pytest.mark.parametrize("variable", ["KVTRACE_SPOOL_DIR", "XDG_DATA_HOME"])
def test_kvtrace_run_refuses_a_read_only_spool_or_data_home_before_the_engine_starts(variable, tmp_path):
    read_only = tmp_path / "read-only"
    with tmpfs(read_only, "1m", read_only=True):
        env = {variable: str(read_only), "KVTRACE_HASH_KEY": ""}
        run = subprocess.run([sys.executable, "-m", "kvtrace.cli", "run", "--", sys.executable, "-c", "pass"],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "Read-only file system" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
