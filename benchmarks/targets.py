"""How the benchmark scripts print whether a run meets a target."""

from __future__ import annotations


def verdict(what: str, value: float, limit: float, unit: str, at_least: bool = False) -> str:
    """``what value unit (<= limit unit: met)``; ``at_least``: the value must reach the limit instead."""
    met = value >= limit if at_least else value <= limit
    shown = f"{value:,.0f}" if limit >= 100 else f"{value:.2f}"
    return f"{what} {shown} {unit} ({'>=' if at_least else '<='} {limit:,g} {unit}: {'met' if met else 'not met'})"
