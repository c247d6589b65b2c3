"""Every command, fed the wrong thing: a file that is not there, a directory where a file belongs, a
FIFO (which would block a reader forever), a file that cannot be read (root ignores permission bits,
so /proc), a file that is not UTF-8, a number that is not a number, a negative count.  Each ends
with one line saying what is wrong and the exit code the README promises — 2 for usage, 1 for a
runtime failure — and never with a traceback (that is for ``--debug`` / ``KVTRACE_DEBUG=1``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvtrace.cli import main

UNREACHABLE = "http://127.0.0.1:9/v1"


class Tripwire:
    """A FIFO that notices a reader: if a command opens it, the command is let go (EOF) and the test fails."""

    def __init__(self, path: Path):
        os.mkfifo(path)
        self.path, self.opened, self._stop = path, threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only once a reader waits
            except OSError:
                time.sleep(0.005)
                continue
            self.opened.set()
            os.close(fd)
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def bad_path(tmp_path: Path, kind: str, fifos: list) -> str:
    if kind == "missing":
        return str(tmp_path / "no-such-file")
    if kind == "directory":
        (tmp_path / "a-directory").mkdir()
        return str(tmp_path / "a-directory")
    if kind == "fifo":
        fifos.append(Tripwire(tmp_path / "a-fifo"))
        return str(fifos[-1].path)
    if kind == "unreadable":
        return "/proc/self/mem"  # a regular file whose read fails, even for root
    if kind == "not-utf8":
        (tmp_path / "latin1.txt").write_bytes(b'{"id": "caf\xe9", "prompt": "caf\xe9"}\n')
        return str(tmp_path / "latin1.txt")
    raise AssertionError(kind)


def prompts_file(tmp_path: Path) -> str:
    (tmp_path / "prompts.jsonl").write_text('{"id": "p1", "prompt": "Hello"}\n')
    return str(tmp_path / "prompts.jsonl")


INPUT_FLAGS = {
    "probe --prompts": lambda p, tmp: ["probe", "--url", UNREACHABLE, "--prompts", p],
    "import FILE": lambda p, tmp: ["import", "--no-ingest", p],
    "diff --model": lambda p, tmp: ["diff", "run-a", "run-b", "--model", p],
    "experiment --model": lambda p, tmp: ["experiment", "--model", p, "--episodes", "1"],
}
"""Commands that read a file the user names (alert --rules: tests/faults/test_alert_faults.py)."""

OUTPUT_FLAGS = {
    "diff --html": lambda p, tmp: ["diff", "run-a", "run-b", "--html", p],
    "make-model --out": lambda p, tmp: ["make-model", "--out", p],
    "experiment --plot": lambda p, tmp: ["experiment", "--generate", "tiny", "--episodes", "1", "--plot", p],
}

BAD_VALUES = [
    ["selfcheck", "--requests", "0"], ["selfcheck", "--requests", "-3"], ["selfcheck", "--requests", "many"],
    ["demo", "--episodes", "0"], ["demo", "--turns", "-1"], ["demo", "--tokens", "1.5"], ["demo", "--seed", "-1"],
    ["experiment", "--generate", "tiny", "--episodes", "-1"], ["experiment", "--generate", "tiny", "--turns", "0"],
    ["experiment", "--generate", "tiny", "--tokens", "0"], ["experiment", "--generate", "tiny", "--repeats", "0"],
    ["experiment", "--generate", "tiny", "--threads", "0"], ["experiment", "--generate", "tiny", "--n-ctx", "-8"],
    ["experiment", "--generate", "tiny", "--formats", "Q9_9"], ["experiment", "--generate", "tiny", "--arms", "x"],
    ["experiment", "--generate", "tiny", "--orders", "random"], ["experiment", "--generate", "huge"],
    ["make-model", "--out", "m.gguf", "--seed", "-1"], ["make-model", "--out", "m.gguf", "--quant", "Q9"],
    ["probe", "--url", UNREACHABLE, "--prompts", "{prompts}", "--warm", "0"],
    ["probe", "--url", UNREACHABLE, "--prompts", "{prompts}", "--max-tokens", "-1"],
    ["probe", "--url", UNREACHABLE, "--prompts", "{prompts}", "--timeout", "nan"],
    ["probe", "--url", UNREACHABLE, "--prompts", "{prompts}", "--timeout", "0"],
    ["diff", "run-a", "run-b", "--near-tie", "nan"], ["diff", "run-a", "run-b", "--near-tie", "-0.5"],
    ["diff", "run-a", "run-b", "--format", "yaml"],
    ["query", "margin_shift", "--param", "since=not-a-date"], ["query", "margin_shift", "--param", "until=50000-01-01"],
    ["query", "near_tie_share", "--param", "near_tie=nan"], ["query", "runs", "--param", "since"],
    ["query", "no_such_query"], ["runs", "--format", "xml"],
    ["--db", "chdb:///proc/kvtrace-db", "runs"], ["--db", "http://localhost:port/db", "runs"],
    ["--db", "mysql://localhost/db", "runs"],
    ["run"], ["no-such-command"],
]


def kvtrace(argv: list[str], capsys) -> tuple[int, str]:
    """``kvtrace ARGV`` as the console script runs it: main()'s return value or argparse's exit."""
    try:
        code = main(["-q", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def says_what_is_wrong_in_one_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert all(n in errors[0] for n in needles), err


@pytest.fixture
def fifos():
    made: list[Tripwire] = []
    yield made
    for fifo in made:
        fifo.close()
        assert not fifo.opened.is_set(), f"a command opened the FIFO {fifo.path} (and would have hung)"


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "unreadable"])
@pytest.mark.parametrize("flag", list(INPUT_FLAGS))
def test_an_input_path_that_is_not_a_readable_file_is_a_usage_error(flag, kind, tmp_path, capsys, fifos):
    path = bad_path(tmp_path, kind, fifos)
    code, err = kvtrace(INPUT_FLAGS[flag](path, tmp_path), capsys)
    assert code == 2, err
    says_what_is_wrong_in_one_line(err, path)


@pytest.mark.parametrize("flag, code", [("probe --prompts", 2), ("import FILE", 1), ("diff --model", 2),
                                        ("experiment --model", 2)])
def test_an_input_file_that_is_not_what_it_should_be_is_refused_in_one_line(flag, code, tmp_path, capsys, fifos):
    # Not UTF-8, and not a model either.  A log whose lines cannot be read is a runtime failure, reported
    # per line (the README's import contract); every other input is a usage error.
    path = bad_path(tmp_path, "not-utf8", fifos)
    got, err = kvtrace(INPUT_FLAGS[flag](path, tmp_path), capsys)
    assert got == code, err
    says_what_is_wrong_in_one_line(err, path)


@pytest.mark.parametrize("kind", ["directory", "fifo", "unreadable"])
@pytest.mark.parametrize("flag", list(OUTPUT_FLAGS))
def test_an_output_path_that_cannot_be_written_is_a_usage_error(flag, kind, tmp_path, capsys, fifos):
    path = {"unreadable": "/proc/kvtrace-output"}.get(kind) or bad_path(tmp_path, kind, fifos)
    code, err = kvtrace(OUTPUT_FLAGS[flag](path, tmp_path), capsys)
    assert code == 2, err
    says_what_is_wrong_in_one_line(err, path)
    assert not Path("/proc/kvtrace-output").exists()


@pytest.mark.parametrize("argv", BAD_VALUES, ids=lambda argv: " ".join(argv))
def test_a_bad_value_is_a_usage_error(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # make-model --out m.gguf must never be written anywhere else
    argv = [a.replace("{prompts}", prompts_file(tmp_path)) for a in argv]
    code, err = kvtrace(argv, capsys)
    assert code == 2, err
    says_what_is_wrong_in_one_line(err)
    assert not (tmp_path / "m.gguf").exists()


def test_an_unknown_run_is_a_runtime_failure(capsys):
    code, err = kvtrace(["diff", "run-a", "run-b"], capsys)
    assert code == 1
    says_what_is_wrong_in_one_line(err, "no run 'run-a'")


def test_an_error_nobody_foresaw_is_one_line_and_debug_shows_where(capsys, monkeypatch):
    from kvtrace import queries

    def broken(*args, **kwargs):
        raise RuntimeError("the unforeseen\nsecond line")

    monkeypatch.setattr(queries, "run", broken)
    code, err = kvtrace(["runs"], capsys)
    assert code == 1
    says_what_is_wrong_in_one_line(err, "RuntimeError: the unforeseen", "--debug")
    assert "second line" not in err
    code, err = kvtrace(["--debug", "runs"], capsys)
    assert code == 1 and "Traceback" in err and "second line" in err
    monkeypatch.setenv("KVTRACE_DEBUG", "1")
    code, err = kvtrace(["runs"], capsys)
    assert code == 1 and "Traceback" in err
