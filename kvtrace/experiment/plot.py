"""The experiment's picture: one panel per compared pair of arms, a bar per weight format and engine
setting.

Each bar is the share of episodes that forked against ``off``, its error bar the report's 95 %
interval over episodes (Wilson, or the cluster bootstrap where episodes hold several samples), and
the label above it the counts behind the rate (forked / episodes). matplotlib is optional (the
``plot`` extra); it is used without pyplot, so nothing global changes in the calling process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

INSTALL_HINT = "pip install 'kvtrace[plot]'"


def compared_pairs(report: dict) -> dict[tuple[str, str], list[dict]]:
    """The report's pairs with a rate, grouped by (arm with its cache size, compared-with arm), in
    the plan's arm order (cache sizes in the order given)."""
    panels: dict[tuple[str, str], list[dict]] = {}
    for pair in report["pairs"]:
        if pair["rate"] is not None:
            panels.setdefault((pair["arm_a"], pair["arm_b"]), []).append(pair)
    arms, sizes = list(report["arms"]), list(report.get("cache_ram", []))

    def rank(key: tuple[str, str]) -> tuple:
        pair = panels[key][0]
        return (arms.index(pair["arm"]) if pair["arm"] in arms else len(arms),
                sizes.index(pair["cache"]) if pair["cache"] in sizes else -1, key)

    return {key: panels[key] for key in sorted(panels, key=rank)}


def interval_extents(rated: dict) -> tuple[float, float]:
    """How far a rate's 95 % interval reaches below and above it (an error bar's extents); an end the
    interval lacks reaches nowhere."""
    rate, (low, high) = rated["rate"], rated["ci95"]
    return rate - (low if low is not None else rate), (high if high is not None else rate) - rate


def _varying_settings(report: dict) -> list[int]:
    """Which parts of the engine-settings label differ between the report's settings (shown on the axis)."""
    labels = [label.split(".") for label in report.get("engine_settings", [])]
    if len(labels) < 2:
        return []
    return [i for i in range(len(labels[0])) if len({parts[i] for parts in labels}) > 1]


def _bar_label(pair: dict, varying: list[int]) -> str:
    parts = pair["settings"].split(".")
    shown = [parts[i] for i in varying if i < len(parts)]
    return "\n".join([pair["format"]] + ([" ".join(shown)] if shown else []))


def divergence_figure(report: dict):
    """A matplotlib ``Figure`` (ImportError without matplotlib); None when no pair has a rate."""
    # Deferred: matplotlib is the optional `plot` extra, and heavy.
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    panels = compared_pairs(report)
    if not panels:
        return None
    formats, settings = list(report["formats"]), list(report.get("engine_settings", []))
    varying = _varying_settings(report)

    def order(pair: dict) -> tuple:
        return (formats.index(pair["format"]) if pair["format"] in formats else len(formats),
                settings.index(pair["settings"]) if pair["settings"] in settings else len(settings))

    most_bars = max(len(pairs) for pairs in panels.values())
    columns = min(len(panels), 3 if most_bars <= 3 else 2)
    rows = math.ceil(len(panels) / columns)
    longest_title = max(len(f"{a} vs {b}") for a, b in panels)
    panel_width = max(3.0, 0.75 * most_bars + 1.2, 0.1 * longest_title + 0.8)  # titles and ticks never overlap
    fig = Figure(figsize=(columns * panel_width, rows * 3.3 + 0.8), layout="constrained")
    axes = list(fig.subplots(rows, columns, sharey=True, squeeze=False).flat)
    # One scale for every panel, tall enough for the highest interval: small rates stay visible.
    y_top = min(1.15, max(0.25, 1.3 * max((p["ci95"][1] or p["rate"]) for pairs in panels.values() for p in pairs)))
    for i, (ax, ((arm_a, arm_b), pairs)) in enumerate(zip(axes, panels.items())):
        bars = sorted(pairs, key=order)
        rates = [p["rate"] for p in bars]
        low, high = zip(*(interval_extents(p) for p in bars))
        ax.bar(range(len(bars)), rates, yerr=[low, high], capsize=4, color="tab:blue", error_kw={"elinewidth": 1})
        for x, (p, above) in enumerate(zip(bars, high)):
            ax.annotate(f"{p['n_forked']}/{p['n_episodes']}", (x, p["rate"] + above), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize=8)
        ax.set_xticks(range(len(bars)), [_bar_label(p, varying) for p in bars], fontsize=8)
        ax.set_title(f"{arm_a} vs {arm_b}", fontsize=10)
        ax.set_ylim(0, y_top)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.grid(axis="y", alpha=0.3)
        if i % columns == 0:
            ax.set_ylabel("episodes forked")
        if i + columns >= len(panels):  # no panel below this one
            ax.set_xlabel("weight format" + (" / engine setting" if varying else ""), fontsize=8, color="dimgray")
    for ax in axes[len(panels):]:
        ax.remove()  # grid cells left over when the panels don't fill the last row
    fig.suptitle(f"{report['prefix']}: episodes that forked against off, {report['episodes']} episodes x "
                 f"{report['turns']} turns (95 % interval over episodes; label forked/episodes)", fontsize=10)
    return fig


def write_plot(report: dict, path: Path) -> Optional[Path]:
    """Write the figure as PNG; None when no pair has a rate. ImportError without matplotlib."""
    fig = divergence_figure(report)
    if fig is None:
        return None
    fig.savefig(path, dpi=120)
    return Path(path)
