"""Ingest against full disks and paths that are no span files: one line, a documented exit code.

The full disk is a real tmpfs of a few MB (``sink_faults.tmpfs``: mounting one needs root; elsewhere
these tests skip and say why, and fail under CI).  Permissions are real too: as root the child runs
without the capabilities that let root read anything (``setpriv``), so a mode-000 directory refuses
it as it would refuse a user.
Exit codes (README): 0 done, 1 runtime failure (unreadable input, database full), 2 usage error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from sink_faults import tmpfs
from span_lines import dead_writer_name, request, spoiled, write_lines

from kvtrace.collectors.quarantine import quarantined_lines


def kvtrace(*args: str, unprivileged: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real CLI in a child process (environment: this test's spool and database)."""
    command = [sys.executable, "-m", "kvtrace.cli", *args]
    if unprivileged and os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot drop the capability to read anything")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvtrace: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _count(query: str) -> int:
    from kvtrace.db import connect

    client = connect(os.environ["KVTRACE_CLICKHOUSE_URL"])
    try:
        return int(client.query(query).result_rows[0][0])
    finally:
        client.close()


def test_a_full_database_disk_stops_ingest_in_one_line_and_keeps_what_is_stored(tmp_path, monkeypatch):
    with tmpfs(tmp_path / "disk", "6m") as disk:
        monkeypatch.setenv("KVTRACE_CLICKHOUSE_URL", f"chdb://{disk / 'db'}")
        spool = tmp_path / "spool"
        spool.mkdir()
        # A first, small run fits; then a run of ~12 MB of spans arrives, more than the disk holds.
        write_lines(dead_writer_name(spool, 0), [request(i, run_id="small-run") for i in range(50)])
        assert kvtrace("db", "ingest").returncode == 0
        big = [write_lines(dead_writer_name(spool, 1 + k), [request(i, run_id="big-run-" + "x" * 3000)
                                                            for i in range(1000 + 800 * k, 1800 + 800 * k)])
               for k in range(5)]
        written = 50 + 800 * len(big)

        full = kvtrace("db", "ingest")
        assert full.returncode == 1
        error = _one_line_error(full)
        assert "ingest stopped" in error and "space" in error and "Everything stored is kept" in error

        # The query side still answers from what is stored, with a warning.
        runs = kvtrace("runs", "--format", "json")
        assert runs.returncode == 0 and "Traceback" not in runs.stderr
        assert "small-run" in {r["run_id"] for r in json.loads(runs.stdout)}
        assert "spool not (fully) ingested" in runs.stderr

        # More room (the same tmpfs, grown): the next ingest goes on and stores everything exactly once.
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
        assert kvtrace("db", "ingest").returncode == 0
        stored = _count("SELECT count() FROM otel_traces")
        quarantined = len(quarantined_lines(spool / "quarantine"))
        assert stored == _count("SELECT uniqExact(TraceId, SpanId) FROM otel_traces")
        assert (stored + quarantined, quarantined) == (written, 0)  # the lines were never the problem


def test_a_quarantine_copy_on_a_full_spool_disk_is_still_reported_and_counted(tmp_path, monkeypatch):
    with tmpfs(tmp_path / "spool-disk", "1m") as spool:
        monkeypatch.setenv("KVTRACE_SPOOL_DIR", str(spool))
        lines = [request(0), spoiled(1, lambda req: req.update(resourceSpans=[1])), request(2)]
        path = write_lines(dead_writer_name(spool, 0), lines)
        filler = os.open(spool / "filler.bin", os.O_WRONLY | os.O_CREAT)
        for size in (65536, 1):  # fill the disk to the last byte
            try:
                while True:
                    os.write(filler, b"\0" * size)
            except OSError:
                pass
        os.close(filler)

        done = kvtrace("db", "ingest", "--format", "json")

        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["spans"], report["quarantined"]) == (2, 1)
        assert report["spans"] + report["quarantined"] == len(lines)
        assert f"{path}:2: " in done.stderr and "the quarantine copy failed: No space left on device" in done.stderr


def test_dev_null_a_fifo_or_a_missing_path_is_a_usage_error(tmp_path):
    fifo = tmp_path / "spans.jsonl"
    os.mkfifo(fifo)
    for path in ("/dev/null", str(fifo), str(tmp_path / "missing.jsonl")):
        result = kvtrace("db", "ingest", path, timeout=60)  # a FIFO must not be opened (it would block)
        assert result.returncode == 2, (path, result.stderr)
        assert path in _one_line_error(result)
    assert "is not a regular file or a directory" in kvtrace("db", "ingest", "/dev/null").stderr


def test_a_directory_or_file_ingest_may_not_read_is_a_runtime_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    write_lines(locked / "spans.jsonl", [request(0)])
    unreadable = write_lines(tmp_path / "unreadable.jsonl", [request(1)])
    locked.chmod(0)
    unreadable.chmod(0)
    try:
        for path in (locked, unreadable):
            result = kvtrace("db", "ingest", str(path), unprivileged=True)
            assert result.returncode == 1, result.stderr
            assert "Permission denied" in _one_line_error(result)
    finally:
        locked.chmod(0o755)


def test_an_unreadable_file_in_the_spool_is_passed_over_and_the_rest_stored(spool_dir):
    spool_dir.mkdir()
    write_lines(dead_writer_name(spool_dir, 0), [request(0), request(1)])
    locked = write_lines(dead_writer_name(spool_dir, 1), [request(2)])
    locked.chmod(0)
    assert kvtrace("db", "status").returncode == 0  # creates the database as this user

    ingest = kvtrace("db", "ingest", unprivileged=True)
    assert ingest.returncode == 1 and f"{locked}: cannot read it: Permission denied" in ingest.stderr
    runs = kvtrace("runs", "--format", "json", unprivileged=True)
    assert runs.returncode == 0 and "Traceback" not in runs.stderr

    locked.chmod(0o644)
    assert kvtrace("db", "ingest").returncode == 0
    assert _count("SELECT count() FROM otel_traces") == 3
