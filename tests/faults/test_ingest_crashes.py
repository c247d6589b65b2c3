"""Exactly-once ingest: a crash at any point, and files that are copies or concatenations.

An ingest process is killed with SIGKILL right after each write it makes (every INSERT into a typed
table, into otel_traces, of line hashes, every progress record, every quarantine copy), and once more
at a spread of moments chosen by the clock, mid-insert included.  The next ingest must finish the job
with every span stored exactly once: spans stored + lines quarantined == lines written, no span twice
in otel_traces, and one row per span in the typed tables as the queries read them (FINAL).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from span_lines import dead_writer_name, request, spoiled, write_lines

from kvtrace.collectors import ingest
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.schema import init_schema
from kvtrace.db import connect

HERE = Path(__file__).parent
CHUNK_BYTES = 4096  # a few lines per chunk, so a file takes several chunks and progress records


def _books(db_path: Path, quarantine: Path) -> dict:
    """What is stored and quarantined, from the database and the quarantine directory."""
    client = connect(f"chdb://{db_path}")
    try:
        stored, distinct = client.query(
            "SELECT count(), uniqExact(TraceId, SpanId) FROM otel_traces").result_rows[0]
        requests = client.query("SELECT count() FROM kvtrace_requests FINAL").result_rows[0][0]
    finally:
        client.close()
    records = [json.loads(text) for f in sorted(quarantine.glob("*.jsonl")) for text in f.read_text().splitlines()]
    return {"stored": stored, "distinct": distinct, "requests": requests,
            "quarantined": sorted((Path(r["file"]).name, r["line"]) for r in records)}


def _spool_with_a_bad_line_and_a_torn_tail(spool: Path) -> tuple[list[Path], int, list[tuple[str, int]]]:
    """Two finished spool files (their writers ended): 14 + 6 lines, one hostile, one torn tail."""
    spool.mkdir(parents=True)
    first = dead_writer_name(spool, 0)
    lines = [request(i) for i in range(12)]
    lines.insert(5, spoiled(99, lambda req: req.update(resourceSpans=[1])))
    write_lines(first, lines)
    with open(first, "a") as f:
        f.write(json.dumps(request(12))[:200])  # the writer died mid-line
    second = dead_writer_name(spool, 1)
    write_lines(second, [request(i) for i in range(20, 26)])
    written = len(lines) + 1 + 6
    return [first, second], written, sorted([(first.name, 6), (first.name, 14)])


def _ingest_child(db_path: Path, quarantine: Path, spool: Path, kill_at: int, timeout: float = 120):
    return subprocess.run(
        [sys.executable, str(HERE / "ingest_until_killed.py"), str(db_path), str(quarantine), str(CHUNK_BYTES),
         str(kill_at), str(spool)],
        capture_output=True, text=True, timeout=timeout)


def test_a_crash_right_after_any_write_of_ingest_stores_nothing_twice(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "CHUNK_BYTES", CHUNK_BYTES)  # the next pass reads as the killed one did
    spool = tmp_path / "spool"
    files, written, bad_lines = _spool_with_a_bad_line_and_a_torn_tail(spool)
    good_spans = written - len(bad_lines)

    dry = _ingest_child(tmp_path / "dry-db", tmp_path / "dry-q", spool, kill_at=0)
    assert dry.returncode == 0, dry.stderr
    steps = re.findall(r"^step (\d+): (.*)$", dry.stdout, re.M)
    span_inserts = sum(table in what for _, what in steps for table in ("otel_traces", "kvtrace_requests"))
    assert len(steps) >= 12 and span_inserts >= 10
    assert _books(tmp_path / "dry-db", tmp_path / "dry-q") == {
        "stored": good_spans, "distinct": good_spans, "requests": good_spans, "quarantined": bad_lines}

    for number, what in steps:
        db_path, quarantine = tmp_path / f"db-{number}", tmp_path / f"q-{number}"
        killed = _ingest_child(db_path, quarantine, spool, kill_at=int(number))
        assert killed.returncode == -signal.SIGKILL, (number, what, killed.stderr[-2000:])
        assert "done:" not in killed.stdout

        client = connect(f"chdb://{db_path}")
        try:
            report = ingest_paths(client, [spool], quarantine_dir=quarantine)
        finally:
            client.close()

        books = _books(db_path, quarantine)
        assert books == {"stored": good_spans, "distinct": good_spans, "requests": good_spans,
                         "quarantined": bad_lines}, f"killed at step {number} ({what})"
        assert books["stored"] + len(books["quarantined"]) == written
        assert "Traceback" not in "".join(report.messages)
        shutil.rmtree(db_path)


def test_ingest_killed_from_outside_at_any_moment_stores_nothing_twice(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "CHUNK_BYTES", 65536)  # the next pass reads as the killed ones did
    spool = tmp_path / "spool"
    spool.mkdir()
    path = dead_writer_name(spool)
    written = 3000
    write_lines(path, [request(i) for i in range(written)])
    db_path, quarantine = tmp_path / "db", tmp_path / "q"

    kills = 0
    for delay in (0.3, 0.6, 0.9, 1.2, 1.5, 1.8, 2.1, 2.4):
        child = subprocess.Popen(
            [sys.executable, str(HERE / "ingest_until_killed.py"), str(db_path), str(quarantine), "65536", "0",
             str(spool)], stdout=subprocess.PIPE, text=True)
        first = child.stdout.readline()  # "step 1: ..." once the database is open and ingest writes
        if first.startswith("done:"):
            child.wait()
            break  # an earlier child finished the job before its kill
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        kills += "done:" not in child.communicate()[0]

    client = connect(f"chdb://{db_path}")
    try:
        ingest_paths(client, [spool], quarantine_dir=quarantine)
    finally:
        client.close()
    books = _books(db_path, quarantine)
    assert kills >= 3  # most kills landed while ingest was still working
    assert books == {"stored": written, "distinct": written, "requests": written, "quarantined": []}


def test_a_chunk_a_kill_lost_after_its_token_was_recorded_is_stored_again(tmp_path):
    """ClickHouse records a block's deduplication token before it moves the block's part into place: a kill
    between the two leaves the token without the rows, and the chunk stored again under it was dropped as a
    copy (the moment the random kills above hit now and then). Made here without a kill, for a file of one
    chunk (a kill leaves at most the chunk it stopped in so): the rows deleted with their parts' tokens
    kept, and ingest's log emptied as a kill before its writes leaves it."""
    spool = tmp_path / "spool"
    spool.mkdir()
    written = 20
    write_lines(dead_writer_name(spool), [request(i) for i in range(written)])
    db_path, quarantine = tmp_path / "db", tmp_path / "q"
    full = {"stored": written, "distinct": written, "requests": written, "quarantined": []}
    client = connect(f"chdb://{db_path}")
    try:
        init_schema(client)
        ingest_paths(client, [spool], quarantine_dir=quarantine)
        client.command("DELETE FROM otel_traces WHERE 1")  # a lightweight delete: the parts, and their tokens, stay
        for table in ("kvtrace_ingest_lines", "kvtrace_ingest_files"):
            client.command(f"TRUNCATE TABLE {table}")
        ingest_paths(client, [spool], quarantine_dir=quarantine)
    finally:
        client.close()
    assert _books(db_path, quarantine) == full


def test_a_concatenation_of_a_stored_file_and_new_spans_stores_the_new_ones(db, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    a = write_lines(dead_writer_name(spool, 0), [request(i) for i in range(5)])
    assert ingest_paths(db, [spool]).spans == 5
    b = write_lines(tmp_path / "b.jsonl", [request(i) for i in range(5, 9)])

    merged = tmp_path / "merged.jsonl"  # cat a.jsonl b.jsonl > merged.jsonl
    merged.write_bytes(a.read_bytes() + b.read_bytes())
    report = ingest_paths(db, [merged])

    assert (report.spans, report.duplicates) == (4, 0)  # resumed after a's bytes: a's spans not even re-read
    stored, distinct = db.query("SELECT count(), uniqExact(SpanId) FROM otel_traces").result_rows[0]
    assert stored == distinct == 9

    # b's spans now stored too: the other order adds nothing, though its first line is new.
    reversed_ = tmp_path / "reversed.jsonl"
    reversed_.write_bytes(b.read_bytes() + a.read_bytes())
    report = ingest_paths(db, [reversed_])
    assert (report.spans, report.duplicates, report.quarantined) == (0, 9, 0)
    assert db.query("SELECT count() FROM otel_traces").result_rows[0][0] == 9


def test_a_file_that_only_shares_its_first_line_is_read_from_the_start(db, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    a = write_lines(dead_writer_name(spool, 0), [request(0), request(1), request(2)])
    assert ingest_paths(db, [spool]).spans == 3
    # Same first line, then something else, longer than a: resuming at a's offset would start
    # in the middle of a line of this file.
    other = write_lines(tmp_path / "other.jsonl", [request(0)] + [request(i, run_id="x" * 300) for i in range(10, 14)])
    assert other.stat().st_size > a.stat().st_size

    report = ingest_paths(db, [other], quarantine_dir=tmp_path / "q")

    assert (report.spans, report.duplicates, report.quarantined) == (4, 1, 0)
    assert db.query("SELECT count(), uniqExact(SpanId) FROM otel_traces").result_rows[0] == (7, 7)


def test_a_copy_of_a_finished_file_is_known_without_reading_it_again(db, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    a = write_lines(dead_writer_name(spool, 0), [request(i) for i in range(4)])
    assert ingest_paths(db, [spool]).spans == 4
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(a.read_bytes())
    report = ingest_paths(db, [copy])
    assert report.files[0].skipped and (report.spans, report.duplicates) == (0, 0)


def test_progress_recorded_by_an_older_kvtrace_is_honoured(db, tmp_path):
    # Before checkpoints carried a prefix hash, a file was keyed by the hash of its first line alone.
    import hashlib

    spool = tmp_path / "spool"
    spool.mkdir()
    path = write_lines(dead_writer_name(spool, 0), [request(i) for i in range(3)])
    first_line = path.read_bytes().split(b"\n")[0] + b"\n"
    assert ingest_paths(db, [path]).spans == 3
    db.command("TRUNCATE TABLE kvtrace_ingest_files")
    db.insert("kvtrace_ingest_files", [[hashlib.sha256(first_line).hexdigest()[:32], str(path), path.stat().st_size,
                                        3, 3, 0, 0, 0]],
              column_names=["file_key", "path", "offset", "lines", "spans", "quarantined", "complete", "updated"])
    with open(path, "a") as f:
        f.write(json.dumps(request(3)) + "\n")

    report = ingest_paths(db, [path])

    assert (report.spans, report.duplicates) == (1, 0)  # resumed at the old offset, not re-read
    assert db.query("SELECT count(), uniqExact(SpanId) FROM otel_traces").result_rows[0] == (4, 4)
