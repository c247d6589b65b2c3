"""`kvtrace experiment --plot` writes the picture it promises: a PNG with one panel per compared pair
of arms (a cache arm once per cache size), a bar per weight format and engine setting with the
report's interval over episodes as error bar. Without matplotlib the command refuses at once, before
any pass runs, and says how to get the plot."""

from __future__ import annotations

import json
import re
import sys

import pytest

pytest.importorskip("llama_cpp")

from kvtrace.cli import main  # noqa: E402
from kvtrace.experiment.plot import INSTALL_HINT, divergence_figure  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def experiment(formats: str, *options: str) -> list[str]:
    return ["experiment", "--generate", "tiny", "--formats", formats, "--episodes", "3", "--turns", "2",
            "--tokens", "8", *options]


def test_the_plot_has_one_panel_per_compared_pair_with_the_reports_rates_and_intervals(capsys, tmp_path,
                                                                                       monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer

    monkeypatch.setenv("KVTRACE_PROGRESS_SECONDS", "0")  # a progress line for every message
    png = tmp_path / "rates.png"
    assert main(experiment("F32,F16", "--arms", "off,reuse,prompt-cache", "--n-ubatch", "256,1", "--format", "json",
                           "--plot", str(png))) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert f"kvtrace: wrote {png}" in captured.err
    # No terminal here: progress comes as log lines with the turns done, the share and an ETA.
    assert re.search(r"^kvtrace: \S+ \d+/72 turns \(\d+%\), \d+s elapsed, ETA \d+s", captured.err, re.M)
    assert png.read_bytes()[:8] == PNG_SIGNATURE

    figure = divergence_figure(report)  # the figure the PNG was drawn from
    compared = {(p["arm_a"], p["arm_b"]) for p in report["pairs"]}
    assert compared == {("reuse", "off"), ("prompt-cache-1GiB", "off")}
    assert [ax.get_title() for ax in figure.axes] == ["reuse vs off", "prompt-cache-1GiB vs off"]
    for ax in figure.axes:
        arm_a, arm_b = ax.get_title().split(" vs ")
        pairs = {f"{p['format']}\n{p['settings'].split('.')[1]}": p for p in report["pairs"]
                 if (p["arm_a"], p["arm_b"]) == (arm_a, arm_b)}
        labels = [label.get_text() for label in ax.get_xticklabels()]
        assert labels == ["F32\nub256", "F32\nub1", "F16\nub256", "F16\nub1"]  # only the knob that varies
        assert [bar.get_height() for bar in ax.patches] == [pairs[label]["rate"] for label in labels]
        (errorbar,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        (vertical_lines,) = errorbar.lines[2]  # one segment per bar, from the interval's low to its high end
        segments = vertical_lines.get_segments()
        assert [[seg[0][1], seg[1][1]] for seg in segments] == [pytest.approx(pairs[lb]["ci95"]) for lb in labels]


def test_without_matplotlib_the_command_refuses_before_running_anything(capsys, tmp_path, monkeypatch, kvtrace_env):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    png = tmp_path / "rates.png"
    assert main(experiment("F32", "--arms", "off,reuse", "--plot", str(png))) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and INSTALL_HINT in captured.err and "--plot needs matplotlib" in captured.err
    assert not png.exists() and not (kvtrace_env / "spool").exists()  # no pass ran
