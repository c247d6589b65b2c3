"""The advice as a picture: each setting's fork rate against what it costs.

x is the time of one probe request relative to the baseline (CPU time, the ranking clock), y the
highest fork rate of its cache arms with that arm's 95 % interval; the label says forked/episodes.
Settings that crashed or have no cost are left out (the table says why). matplotlib without pyplot,
as in the experiment's plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvtrace.advise.report import RANK_CLOCK
from kvtrace.experiment.plot import interval_extents


def _points(report: dict) -> list[tuple[dict, dict]]:
    """(setting, its worst arm) for each setting with a rate and a cost."""
    points = []
    for s in report["settings"]:
        rated = [a for a in s["arms"] if a["rate"] is not None]
        if s["crashed"] or s["cost"] is None or not rated:
            continue
        points.append((s, max(rated, key=lambda a: (a["rate"], a["ci95"][1] or 0))))
    return points


def advice_figure(report: dict):
    """A matplotlib ``Figure`` (ImportError without matplotlib); None when no setting has a point."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    points = _points(report)
    if not points:
        return None
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    recommended = report["recommendation"]["name"]
    for s, arm in points:
        x, rate = s["cost"]["request_time_ratio"][RANK_CLOCK], arm["rate"]
        below, above = interval_extents(arm)
        color = "tab:green" if s["name"] == recommended else "tab:blue"
        ax.errorbar([x], [rate], yerr=[[below], [above]], fmt="o", color=color, capsize=4, elinewidth=1)
        ax.annotate(f"{s['name']} {arm['n_forked']}/{arm['n_episodes']}", (x, rate), xytext=(5, 4),
                    textcoords="offset points", fontsize=8)
    ax.axvline(1.0, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel(f"time per request relative to the baseline ({RANK_CLOCK} time; right = slower)")
    ax.set_ylabel("episodes forked (worst cache arm)")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylim(0, min(1.1, max(0.25, 1.2 * max((a["ci95"][1] or a["rate"]) for _, a in points))))
    ax.grid(alpha=0.3)
    ax.margins(x=0.2)
    ax.set_title(f"{Path(report['model']).name} ({report['weight_format']}): fork rate vs speed cost\n"
                 f"{report['workload']['episodes']} episodes per arm, 95 % interval; green: recommended", fontsize=9)
    return fig


def write_plot(report: dict, path: Path) -> Optional[Path]:
    """Write the figure as PNG; None when no setting has a point. ImportError without matplotlib."""
    fig = advice_figure(report)
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    return Path(path)
