"""A long command shows how far it is: on a terminal a tqdm bar with rate and ETA, without one (a CI
log, nohup, a file) a plain line at most every KVTRACE_PROGRESS_SECONDS, and nothing with --quiet."""

from __future__ import annotations

import io
import re

import pytest

from kvtrace import progress
from kvtrace.errors import ConfigError


def test_without_a_terminal_a_line_with_count_share_elapsed_time_and_eta():
    out = io.StringIO()
    shown = progress.LogProgress(out, interval=0)
    shown("loading the model")
    shown.start(40, "turns")
    for turn in range(4):
        shown.advance(10)
        shown(f"run r0 episode {turn}")
    shown.close()
    lines = out.getvalue().splitlines()
    assert all(line.startswith("kvtrace: ") for line in lines)
    assert "loading the model" in lines[0]
    assert re.search(r"10/40 turns \(25%\), \d+s elapsed, ETA \d+s", out.getvalue())
    assert "40/40 turns (100%)" in lines[-1] and "run r0 episode 3" in lines[-1]


def test_lines_come_no_more_often_than_the_interval():
    out = io.StringIO()
    shown = progress.LogProgress(out, interval=3600)
    shown.start(100, "turns")  # the start is always shown
    for _ in range(100):
        shown.advance()
        shown("busy")
    assert len(out.getvalue().splitlines()) == 1
    shown.close()  # and so is the end
    assert "100/100 turns" in out.getvalue().splitlines()[-1]


def test_on_a_terminal_a_bar_with_eta():
    out = io.StringIO()
    bar = progress.BarProgress(out)
    bar.start(8, "turns")
    bar.advance(4)
    bar("episode 3")
    shown = bar.bar.format_dict  # tqdm renders the ETA from these: done, total and rate
    bar.close()
    assert (shown["n"], shown["total"], shown["unit"]) == (4, 8, " turns")
    assert "4/8" in out.getvalue() and "episode 3" in out.getvalue()


def test_the_interval_is_configurable_and_checked(monkeypatch, capsys):
    monkeypatch.setenv("KVTRACE_PROGRESS_SECONDS", "5")
    assert progress.log_interval() == 5
    monkeypatch.setenv("KVTRACE_PROGRESS_SECONDS", "soon")
    with pytest.raises(ConfigError, match="KVTRACE_PROGRESS_SECONDS"):
        progress.log_interval()
    monkeypatch.delenv("KVTRACE_PROGRESS_SECONDS")
    assert isinstance(progress.for_stderr(), progress.LogProgress)  # pytest's stderr is no terminal
    assert type(progress.for_stderr(quiet=True)) is progress.Progress
