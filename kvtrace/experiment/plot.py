"""The experiment's picture: one panel per compared pair of arms, a bar per weight format.

Each bar is the share of episodes that forked, its error bar the report's 95 % interval, and the
label above it the counts behind the rate (forked / compared). matplotlib is optional (the
``plot`` extra); it is used without pyplot, so nothing global changes in the calling process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

INSTALL_HINT = "pip install 'kvtrace[plot]'"


def compared_pairs(report: dict) -> dict[tuple[str, str], list[dict]]:
    """The report's pairs with a rate, grouped by (arm, compared-with arm): arms against the
    baseline first, then each arm's repeats against each other, both in the plan's arm order."""
    panels: dict[tuple[str, str], list[dict]] = {}
    for pair in report["pairs"]:
        if pair["rate"] is not None:
            panels.setdefault((pair["arm_a"], pair["arm_b"]), []).append(pair)
    arms = list(report["arms"])

    def rank(arm: str) -> int:
        return arms.index(arm) if arm in arms else len(arms)

    ordered = sorted(panels, key=lambda key: (key[0] == key[1], rank(key[0]), rank(key[1]), key))
    return {key: panels[key] for key in ordered}


def divergence_figure(report: dict):
    """A matplotlib ``Figure`` (ImportError without matplotlib); None when no pair has a rate."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    panels = compared_pairs(report)
    if not panels:
        return None
    formats = list(report["formats"])
    columns = min(len(panels), 3)
    rows = math.ceil(len(panels) / columns)
    longest_title = max(len(f"{a} vs {b}") for a, b in panels)
    panel_width = max(2.8, 0.8 * len(formats) + 1.2, 0.09 * longest_title + 0.6)  # titles never overlap
    fig = Figure(figsize=(columns * panel_width, rows * 3.0 + 0.7), layout="constrained")
    axes = list(fig.subplots(rows, columns, sharey=True, squeeze=False).flat)
    for ax, ((arm_a, arm_b), pairs) in zip(axes, panels.items()):
        by_format = {p["format"]: p for p in pairs}
        shown = [f for f in formats if f in by_format] + sorted(set(by_format) - set(formats))
        bars = [by_format[f] for f in shown]
        rates = [p["rate"] for p in bars]
        low = [p["rate"] - (p["ci95"][0] if p["ci95"][0] is not None else p["rate"]) for p in bars]
        high = [(p["ci95"][1] if p["ci95"][1] is not None else p["rate"]) - p["rate"] for p in bars]
        ax.bar(range(len(bars)), rates, yerr=[low, high], capsize=4, color="tab:blue" if arm_a != arm_b else "tab:gray",
               error_kw={"elinewidth": 1})
        for x, (p, top) in enumerate(zip(bars, high)):
            ax.annotate(f"{p['n_forked']}/{p['n_episodes']}", (x, p["rate"] + top), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize=8)
        ax.set_xticks(range(len(bars)), shown, fontsize=9)
        ax.set_title(f"{arm_a} vs {arm_b}", fontsize=10)
        ax.set_xlabel("weight format" + (", repeats/orders of one arm" if arm_a == arm_b else ""), fontsize=8,
                      color="dimgray")
        ax.set_ylim(0, 1.12)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[len(panels):]:
        ax.remove()  # grid cells left over when the panels don't fill the last row
    for ax in fig.axes:
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("episodes forked")
    fig.suptitle(f"{report['prefix']}: episodes that forked (95 % interval; label forked/compared)", fontsize=10)
    return fig


def write_plot(report: dict, path: Path) -> Optional[Path]:
    """Write the figure as PNG; None when no pair has a rate. ImportError without matplotlib."""
    fig = divergence_figure(report)
    if fig is None:
        return None
    fig.savefig(path, dpi=120)
    return Path(path)
