"""`kvtrace experiment --plot` writes the picture it promises: a PNG with one panel per compared pair
of arms, a bar per weight format with the report's interval as error bar. Without matplotlib the
command says how to get the plot and still prints its report and exits 0."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("llama_cpp")

from kvtrace.cli import main  # noqa: E402
from kvtrace.experiment.plot import INSTALL_HINT, divergence_figure  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def experiment(formats: str, *options: str) -> list[str]:
    return ["experiment", "--generate", "tiny", "--formats", formats, "--episodes", "3", "--turns", "2",
            "--tokens", "8", *options]


def test_the_plot_has_one_panel_per_compared_pair_with_the_reports_rates_and_intervals(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer

    png = tmp_path / "rates.png"
    assert main(experiment("F32,F16", "--arms", "off,reuse,prompt-cache", "--format", "json", "--plot", str(png))) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert f"kvtrace: wrote {png}" in captured.err
    assert png.read_bytes()[:8] == PNG_SIGNATURE

    figure = divergence_figure(report)  # the figure the PNG was drawn from
    compared = {(p["arm_a"], p["arm_b"]) for p in report["pairs"]}
    assert compared == {("reuse", "off"), ("prompt-cache", "off")}
    assert sorted(ax.get_title() for ax in figure.axes) == sorted(f"{a} vs {b}" for a, b in compared)
    for ax in figure.axes:
        arm_a, arm_b = ax.get_title().split(" vs ")
        pairs = {p["format"]: p for p in report["pairs"] if (p["arm_a"], p["arm_b"]) == (arm_a, arm_b)}
        formats = [label.get_text() for label in ax.get_xticklabels()]
        assert formats == ["F32", "F16"]
        assert [bar.get_height() for bar in ax.patches] == [pairs[f]["rate"] for f in formats]
        (errorbar,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        (vertical_lines,) = errorbar.lines[2]  # one segment per bar, from the interval's low to its high end
        segments = vertical_lines.get_segments()
        assert [[seg[0][1], seg[1][1]] for seg in segments] == [pytest.approx(pairs[f]["ci95"]) for f in formats]


def test_without_matplotlib_the_command_says_how_to_get_the_plot_and_carries_on(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    png = tmp_path / "rates.png"
    assert main(experiment("F32", "--arms", "off,reuse", "--plot", str(png))) == 0
    captured = capsys.readouterr()
    assert "divergence (episodes that forked)" in captured.out
    assert INSTALL_HINT in captured.err and "matplotlib" in captured.err
    assert not png.exists()
