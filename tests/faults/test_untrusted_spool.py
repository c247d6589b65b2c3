"""A spool directory is shared ground: whoever can write to it can leave a link to /etc/passwd, to a
private file of the user's, to /proc/self/environ or /dev/zero, or a FIFO, under a span file's or a
counters file's name.  Ingest and `db status` read regular files only, never through a link, never
without a bound; what they pass over they name and count, and nothing of it is stored or copied."""

from __future__ import annotations

import json
import os

import pytest

from span_lines import dead_writer_name, request, write_lines

from kvtrace.cli import main
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.recording.stats import FILE_BYTES, StatsFile

MARKER = "kvtrace-secret-marker-5f1c"


@pytest.fixture
def planted(spool_dir, tmp_path, monkeypatch):
    """A spool with one real span file beside a FIFO and links to other files, all named like span files."""
    monkeypatch.setenv("KVTRACE_TEST_SECRET", MARKER)  # what /proc/self/environ would give away
    spool_dir.mkdir(parents=True)
    write_lines(dead_writer_name(spool_dir, 0), [request(0), request(1)])
    private = write_lines(tmp_path / "private.jsonl", [request(7, run_id=MARKER)])
    private.chmod(0o600)
    os.mkfifo(spool_dir / "fifo.jsonl")
    links = {"passwd.jsonl": "/etc/passwd", "private.jsonl": private, "environ.jsonl": "/proc/self/environ",
             "zero.json": "/dev/zero", "nowhere.jsonl": tmp_path / "missing"}
    for name, target in links.items():
        (spool_dir / name).symlink_to(target)
    return sorted(["fifo.jsonl", *links])


def _nothing_of_them_kept(db, spool_dir):
    stored = db.query("SELECT count(), countIf(SpanAttributes['kvtrace.run_id'] = {m:String}) FROM otel_traces",
                      parameters={"m": MARKER}).result_rows[0]
    assert stored == (2, 0)
    quarantine = spool_dir / "quarantine"
    kept = "".join(p.read_text() for p in quarantine.iterdir()) if quarantine.exists() else ""
    assert "root:" not in kept and MARKER not in kept


def test_ingest_reads_only_the_regular_file_and_names_what_it_passed_over(planted, spool_dir, db):
    report = ingest_paths(db, [spool_dir])

    assert (report.spans, report.quarantined, len(report.files)) == (2, 0, 1)
    assert sorted(os.path.basename(entry.split(" (")[0]) for entry in report.passed_over) == planted
    assert "(a FIFO)" in " ".join(report.passed_over) and "(a symbolic link)" in " ".join(report.passed_over)
    assert report.messages[0].startswith(f"{len(planted)} entries passed over, never read")
    _nothing_of_them_kept(db, spool_dir)


def test_the_command_warns_with_a_count_and_still_exits_0(planted, spool_dir, capsys):
    assert main(["db", "ingest"]) == 0
    out, err = capsys.readouterr()
    assert "ingested 2 spans from 1 file(s)" in out
    assert f"{len(planted)} entries passed over, never read" in err and "and 1 more" in err
    assert "Traceback" not in err
    from kvtrace.db import connect

    client = connect()
    try:
        _nothing_of_them_kept(client, spool_dir)
    finally:
        client.close()


def test_a_query_command_is_not_held_up_by_a_fifo_in_the_spool(planted, capsys):
    assert main(["runs", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert [r["run_id"] for r in json.loads(out)] == ["fault-run"]
    assert "passed over, never read" in err


def test_db_status_names_what_it_could_not_read_and_shows_the_rest(planted, spool_dir, capsys):
    stats_dir = spool_dir / "stats"
    stats = StatsFile.create(spool_dir, "host-1-1")
    stats.publish({"spans_finished": 4, "spans_spooled": 4})
    stats.close()
    (stats_dir / "zero.stats").symlink_to("/dev/zero")
    os.mkfifo(stats_dir / "fifo.stats")
    (stats_dir / "large.stats").write_bytes(b" " * (FILE_BYTES + 1))
    (spool_dir / "quarantine").symlink_to(spool_dir / "quarantine")  # a link loop

    assert main(["db", "status", "--format", "json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["span_counters"]["spans_finished"] == 4
    assert [os.path.basename(p["path"])[:8] for p in status["pending_files"]] == ["kvtrace-"]
    problems = "\n".join(status["unreadable"])
    for name in ("zero.stats (a symbolic link): not read", "fifo.stats (a FIFO): not read",
                 "large.stats: cannot read it", "quarantine: cannot list it",
                 *(f"{name} (" for name in planted)):
        assert name in problems, (name, problems)

    assert main(["db", "status"]) == 0
    out = capsys.readouterr().out
    assert "database:" in out and "spans_finished" in out and "not read:" in out and "large.stats" in out


def test_db_status_with_an_unreadable_spool_directory_shows_the_database(spool_dir, capsys):
    spool_dir.symlink_to(spool_dir)  # a loop: every look into it fails, as a directory of another user's would

    assert main(["db", "status", "--format", "json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["tables"]["otel_traces"] == 0 and status["database"]
    assert any(str(spool_dir) in problem for problem in status["unreadable"])


@pytest.mark.parametrize("spool", ["missing", "empty"])
def test_ingest_with_no_spool_yet_or_an_empty_one_has_nothing_to_ingest(spool, spool_dir, capsys):
    if spool == "empty":
        spool_dir.mkdir()
    assert main(["db", "ingest"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("kvtrace: nothing to ingest") and str(spool_dir) in out and not err
    assert main(["db", "ingest", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["spans"] == 0


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_line_longer_than_the_bound_is_quarantined_by_its_start_and_the_rest_stored(where, db, tmp_path,
                                                                                     monkeypatch):
    from kvtrace.collectors import ingest

    monkeypatch.setattr(ingest, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(ingest, "CHUNK_BYTES", 1000)  # the long line spans many reads
    monkeypatch.setattr(ingest, "QUARANTINED_PREFIX_BYTES", 100)
    lines = [request(i) for i in range(3)]
    at = {"first": 0, "middle": 1, "last": 3}[where]
    lines.insert(at, "x" * 50_000)
    path = write_lines(dead_writer_name(tmp_path, 0), lines)

    report = ingest_paths(db, [path], quarantine_dir=tmp_path / "q")

    assert (report.spans, report.quarantined) == (3, 1)
    assert report.files[0].messages[0].startswith(f"{path}:{at + 1}: a line longer than 4,096 bytes")
    (record,) = [json.loads(t) for t in (tmp_path / "q" / f"{path.name}.quarantine.jsonl").read_text().splitlines()]
    assert record["line"] == at + 1 and record["text"] == "x" * 100
    assert ingest_paths(db, [path], quarantine_dir=tmp_path / "q").spans == 0  # finished: nothing read again
    assert db.query("SELECT count() FROM otel_traces").result_rows[0][0] == 3
