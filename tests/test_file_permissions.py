"""What kvtrace writes is its user's alone: with `ids` capture a spool holds prompt and output token ids,
a quarantined line holds the same, so under the common umask 022 every directory kvtrace makes is
0700 and every file 0600, and a link planted where kvtrace will write is never written through."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

from kvtrace import semconv as sc
from kvtrace.analysis.forks import CachePath, Fork, Side
from kvtrace.cli import main
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.config import data_home
from kvtrace.recording.exporters.spool import SpoolWriter
from kvtrace.recording.stats import StatsFile
from kvtrace.replay import verdicts
from kvtrace.replay.reproduce import Counterfactual

VERDICT = Counterfactual("run-a", "run-b", "e0", 1, 2, "hit_vs_recompute", "a" * 16, "b" * 16, "confirmed",
                         "the cached path chose 7 on both", (7, 9), (7, 9), (7, 9))
RULES = {"rules": [{"name": "shift", "metric": "margin_shift_p95_abs", "threshold": 0.1, "window": "30m"}]}


@pytest.fixture(autouse=True)
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def victim(tmp_path):
    """Another file of the user's, readable to others, that a planted link points at."""
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_every_file_kvtrace_makes_is_0600_and_every_directory_0700(spool_recorder, spool_dir, tmp_path, capsys):
    record = spool_recorder.start_request("test_engine", model="tiny")
    record.prompt_token_ids = [11, 12, 13]
    record.add_token(7, 7, 8, 0.5, -0.1)
    spool_recorder.finish(record)
    spool_recorder.pipeline.force_flush()
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("{not json\n")
    assert main(["-q", "db", "ingest", str(foreign)]) == 0  # the spool, and a line for the quarantine
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(RULES))
    assert main(["-q", "alert", "--rules", str(rules)]) == 0
    verdicts.keep(VERDICT)
    spool_recorder.shutdown()
    capsys.readouterr()

    home = data_home()
    made = {
        "spool file": next(spool_dir.glob("*.jsonl")),
        "counters": next((spool_dir / "stats").glob("*.stats")),
        "quarantine": spool_dir / "quarantine" / "foreign.jsonl.quarantine.jsonl",
        "alert state": next((home / "alerts").glob("*.json")),
        "verdicts": verdicts.verdicts_file(),
    }
    assert all(path.is_file() for path in made.values()), made
    found = {}
    for top in (spool_dir, home):
        found[top] = _mode(top)
        for directory, dirs, files in os.walk(top):
            if directory == str(home / "db"):
                dirs.clear()  # the embedded database's own files: the directory holding them is checked
            for name in dirs + files:
                found[os.path.join(directory, name)] = _mode(os.path.join(directory, name))
    wrong = {path: oct(mode) for path, mode in found.items()
             if mode != (0o700 if os.path.isdir(path) else 0o600)}
    assert not wrong, wrong
    assert {str(path) for path in made.values()} <= set(map(str, found))


def test_a_link_planted_at_the_next_spool_file_is_passed_by(spool_dir, victim):
    writer = SpoolWriter(spool_dir, rotate_bytes=1)
    writer.write_line(b"{}\n")
    planted = writer.path.with_name(writer.path.name.replace("-000000.", "-000001."))
    planted.symlink_to(victim)
    writer.write_line(b"{}\n")  # rotates: the next name is taken, so the one after
    writer.close()
    assert writer.path.name.endswith("-000002.jsonl") and writer.path.read_bytes() == b"{}\n"
    assert victim.read_text() == "precious\n" and _mode(writer.path) == 0o600


def test_a_link_planted_at_a_counters_file_is_passed_by(spool_dir, victim):
    (spool_dir / "stats").mkdir(parents=True)
    (spool_dir / "stats" / "host-1-1.stats").symlink_to(victim)
    stats = StatsFile.create(spool_dir, "host-1-1")
    assert stats is not None and stats.publish({"spans_finished": 3})
    stats.close()
    assert data_home() in stats.path.parents  # the fallback place
    assert victim.read_text() == "precious\n"


def test_a_link_planted_at_the_quarantine_file_is_not_written_through(db, tmp_path, victim):
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("{not json\n")
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "foreign.jsonl.quarantine.jsonl").symlink_to(victim)

    report = ingest_paths(db, [foreign], quarantine_dir=tmp_path / "q")

    assert report.quarantined == 1 and "the quarantine copy failed" in report.files[0].messages[0]
    assert victim.read_text() == "precious\n"


def test_a_quarantine_directory_that_is_a_link_is_not_written_to(db, tmp_path):
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("{not json\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "q").symlink_to(elsewhere)

    report = ingest_paths(db, [foreign], quarantine_dir=tmp_path / "q")

    assert report.quarantined == 1 and "symbolic link" in report.files[0].messages[0]
    assert list(elsewhere.iterdir()) == []


def test_alert_state_at_a_link_is_refused_and_the_target_kept(tmp_path, victim, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(RULES))
    state = tmp_path / "state.json"
    state.symlink_to(victim)

    assert main(["-q", "alert", "--rules", str(rules), "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "Traceback" not in err
    assert victim.read_text() == "precious\n"


def test_alert_state_replaces_itself_and_leaves_no_file_under_a_predictable_name(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(RULES))
    state_dir = tmp_path / "state"
    for _ in range(2):
        assert main(["-q", "alert", "--rules", str(rules), "--state", str(state_dir / "state.json")]) == 0
    capsys.readouterr()
    assert [p.name for p in state_dir.iterdir()] == ["state.json"]
    assert (_mode(state_dir), _mode(state_dir / "state.json")) == (0o700, 0o600)


def _fork() -> Fork:
    def side(run: str, span: str, token: int) -> Side:
        return Side(run, span, span, token, -1, 0.01, CachePath(sc.LAYER_NONE, 0, 4, "", "", -1))

    return Fork("e0", 1, sc.FORK_KIND_OUTPUT, 2, sc.ATTRIBUTION_HIT_VS_RECOMPUTE, "", "run-a", "run-b",
                side("run-a", "a" * 16, 7), side("run-b", "b" * 16, 9), True, 0.01, sc.CAPTURE_IDS, None)


def test_verdicts_at_a_link_are_neither_written_nor_read(tmp_path):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(json.dumps(VERDICT.to_json()) + "\n")
    path = verdicts.verdicts_file()
    path.parent.mkdir(parents=True)
    path.symlink_to(elsewhere)
    with pytest.raises(OSError):
        verdicts.keep(VERDICT)
    assert len(elsewhere.read_text().splitlines()) == 1
    fork = _fork()
    verdicts.attach([fork])
    assert fork.verdict is None  # the verdict behind the link was not read

    path.unlink()
    verdicts.keep(VERDICT)
    verdicts.attach([fork])
    assert fork.verdict == "confirmed" and _mode(path) == 0o600
