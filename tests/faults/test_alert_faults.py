"""``kvtrace alert`` runs from cron, and cron reads its exit code: 0 all clear, 1 firing, 2 could not
evaluate.  Whatever goes wrong — a rules file that is not UTF-8 or not a file, a state file that is
not a state file, a state directory that cannot be written, a spool line of the wrong shape, a bug —
must never read as "firing": it exits 2 with one line saying why (the traceback only with --debug),
or, where the fault can be repaired (a damaged state file), repairs it with a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from kvtrace.cli import main

RULE = {"name": "margin-shift-p95", "metric": "margin_shift_p95_abs", "threshold": 0.1, "window": "30m"}


@pytest.fixture
def alert(tmp_path, capsys):
    """Runs ``kvtrace alert`` (in-process, like the console script) on an empty embedded database."""

    def run(*args, rules=None, state=None, options=()):
        if rules is None:
            rules = tmp_path / "rules.yaml"
            rules.write_text(yaml.safe_dump({"rules": [RULE]}))
        argv = ["--db", f"chdb://{tmp_path / 'db'}", "--spool-dir", str(tmp_path / "spool"), "-q", *options,
                "alert", "--rules", str(rules)]
        if state is not False:
            argv += ["--state", str(state or tmp_path / "state.json")]
        code = main(argv + list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def one_error_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), err


def test_a_clean_evaluation_of_an_empty_database_is_all_clear(alert):
    code, out, _ = alert()
    assert code == 0 and "all clear" in out


def test_a_rules_file_that_is_not_utf8_cannot_be_evaluated(alert, tmp_path):
    rules = tmp_path / "latin1.yaml"
    rules.write_bytes(yaml.safe_dump({"rules": [{**RULE, "name": "café"}]}, allow_unicode=True)
                      .encode("utf-8").replace("é".encode(), b"\xe9"))
    code, _, err = alert(rules=rules)
    assert code == 2
    one_error_line(err, "could not evaluate", "not UTF-8")


@pytest.mark.parametrize("kind", ["directory", "fifo", "proc"])
def test_a_rules_path_that_is_not_a_readable_file_cannot_be_evaluated(alert, tmp_path, kind):
    if kind == "directory":
        rules = tmp_path / "rules.d"
        rules.mkdir()
    elif kind == "fifo":
        rules = tmp_path / "rules.fifo"
        os.mkfifo(rules)  # reading it would wait for a writer forever
    else:
        rules = "/proc/self/mem"  # a regular file whose read fails, even for root
    code, _, err = alert(rules=rules)
    assert code == 2
    one_error_line(err, "could not evaluate", str(rules))


@pytest.mark.parametrize("field, value", [("threshold", float("nan")), ("threshold", float("inf")),
                                          ("threshold", "high"), ("window", float("inf")),
                                          ("near_tie", float("nan")), ("near_tie", -0.1)])
def test_thresholds_must_be_finite_numbers(alert, tmp_path, field, value):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"rules": [{**RULE, field: value}]}))
    code, _, err = alert(rules=rules)
    assert code == 2
    one_error_line(err, "could not evaluate", field)


@pytest.mark.parametrize("content", [b"[]", b"{}", b'{"alerts": []}', b"\xff\xfe", b"{not json",
                                     b'{"alerts": {"f1": {"rule": "r", "labels": {}, "annotations": {}, '
                                     b'"status": "firing", "starts_at": "yesterday"}}}'])
def test_a_corrupt_state_file_is_set_aside_and_rebuilt(alert, tmp_path, content):
    state = tmp_path / "state.json"
    state.write_bytes(content)
    code, out, err = alert(state=state)
    assert code == 0 and "all clear" in out
    assert "Traceback" not in err and "kvtrace: warning: alert state" in err and "moved to" in err
    (aside,) = tmp_path.glob("state.json.corrupt-*")
    assert aside.read_bytes() == content  # kept for whoever wants to look at it
    assert json.loads(state.read_text()) == {"alerts": {}}
    code, _, err = alert(state=state)  # the rebuilt file is a state file
    assert code == 0 and err == ""


@pytest.mark.parametrize("where", ["parent is a file", "in /proc", "a directory"])
def test_an_unwritable_state_path_cannot_be_evaluated(alert, tmp_path, where):
    # Root ignores permission bits, so the paths are ones nobody can write to.
    if where == "parent is a file":
        (tmp_path / "plain").write_text("")
        state = tmp_path / "plain" / "state.json"
    elif where == "in /proc":
        state = "/proc/kvtrace-alert-state.json"
    else:
        state = tmp_path / "state-dir"
        state.mkdir()
    code, out, err = alert(state=state)
    assert code == 2 and out == ""  # nothing evaluated, nothing delivered: it could not be remembered
    one_error_line(err, "could not evaluate", "alert state")


def test_an_unwritable_default_state_dir_cannot_be_evaluated(alert, tmp_path, monkeypatch):
    (tmp_path / "data-file").write_text("")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data-file"))
    code, _, err = alert(state=False)
    assert code == 2
    one_error_line(err, "could not evaluate", "alert state")


@pytest.mark.parametrize("flags, needle", [(["--watch", "nan"], "--watch"), (["--watch", "-1"], "--watch"),
                                           (["--watch", "1", "--cycles", "0"], "--cycles"),
                                           (["--cycles", "2"], "--cycles"), (["--at", "nan"], "--at"),
                                           (["--at", "1e300"], "--at"), (["--at", "next tuesday"], "--at")])
def test_bad_options_cannot_be_evaluated(alert, flags, needle):
    code, _, err = alert(*flags)
    assert code == 2
    one_error_line(err, "could not evaluate", needle)


def test_a_spool_line_of_the_wrong_shape_never_reads_as_firing(alert, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "other-tool.jsonl").write_text('{"resourceSpans": [1]}\n')
    code, out, err = alert()
    assert "Traceback" not in err
    # Quarantined by ingest (all clear, with a warning) or, failing that, not evaluated: never "firing".
    assert (code, "all clear" in out) == (0, True) or (code == 2 and "could not evaluate rule" in err), (code, err)


def test_an_internal_error_during_evaluation_exits_2_not_1(alert, tmp_path, monkeypatch):
    import kvtrace.commands.common

    def broken(*args, **kwargs):
        raise AttributeError("'int' object has no attribute 'get'")

    (tmp_path / "spool").mkdir()  # every evaluation ingests the spool first
    monkeypatch.setattr(kvtrace.commands.common, "ingest_paths", broken)
    code, _, err = alert()
    assert code == 2
    assert "could not evaluate rule margin-shift-p95: AttributeError: 'int' object has no attribute 'get'" in err


def test_an_internal_error_anywhere_exits_2_and_debug_shows_the_traceback(alert, monkeypatch):
    import kvtrace.alerts.cycle

    def broken(*args, **kwargs):
        raise KeyError("fingerprint")

    monkeypatch.setattr(kvtrace.alerts.cycle, "apply", broken)
    code, _, err = alert()
    assert code == 2
    one_error_line(err, "could not evaluate", "KeyError")
    code, _, err = alert(options=["--debug"])
    assert code == 2 and "Traceback" in err and "KeyError: 'fingerprint'" in err
    monkeypatch.setenv("KVTRACE_DEBUG", "1")
    code, _, err = alert()
    assert code == 2 and "Traceback" in err


def test_from_cron_a_non_utf8_rules_file_is_exit_2_and_one_line(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_bytes(b"rules:\n  - name: caf\xe9\n")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "--db", f"chdb://{tmp_path / 'db'}", "alert",
                           "--rules", str(rules)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    one_error_line(proc.stderr, "not UTF-8")


@pytest.fixture
def evaluation_process_that(tmp_path, monkeypatch):
    """Makes every Python started from here on (the watch's evaluation process) run ``code`` first."""

    def run_first(code: str) -> None:
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(code)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))

    return run_first


def test_a_watch_whose_evaluation_process_is_killed_reports_it_and_keeps_watching(alert, evaluation_process_that):
    evaluation_process_that("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    code, out, err = alert("--watch", "0.01", "--cycles", "2")
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("kvtrace: error:")]
    assert errors == ["kvtrace: error: could not evaluate rule margin-shift-p95: "
                      "the evaluation process died with SIGKILL"] * 2, err


def test_a_watch_whose_evaluation_process_hangs_gives_up_on_it_after_the_timeout(alert, evaluation_process_that,
                                                                                  monkeypatch):
    import kvtrace.commands.alert_database

    evaluation_process_that("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(kvtrace.commands.alert_database, "ISOLATED_TIMEOUT_S", 1.0)
    code, out, err = alert("--watch", "0.01", "--cycles", "1")
    assert code == 2 and "Traceback" not in err
    one_error_line(err, "could not evaluate rule margin-shift-p95", "did not finish within 1 s")
