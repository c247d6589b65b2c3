"""One fork as the lines ``kvtrace diff`` prints (``kvtrace demo`` explains its fork the same way)."""

from __future__ import annotations

from kvtrace import semconv as sc
from kvtrace.analysis.forks import Fork, Side


def describe_fork(fork: Fork) -> str:
    """Where it forked and its label, each side's token, margin and cache path, then what explains it."""
    lines = [f"episode {fork.episode}: forked at {fork.where()} [{fork.label()}]"]
    if fork.kind == sc.FORK_KIND_PROMPT:
        lines.append(f"  {fork.note}")
    for label, side in (("A", fork.a), ("B", fork.b)):
        lines.append(f"  {label} {side.run:<14} chose {_token(side, fork.position)}  "
                     f"margin {_margin(side.margin)}  "
                     f"runner-up {side.runner_up}  | {side.cache.describe()}")
    for label, side in (("A", fork.a), ("B", fork.b)):
        if cut := side.rows_cut_before(fork.position):
            lines.append(f"  {label} has no margin at the fork: {cut}")
    if fork.position >= 0:
        tie = "yes" if fork.near_tie else "no"
        share = "" if fork.margin_share != fork.margin_share else f"; margin within the lowest {fork.margin_share:.1%} of both runs"
        lines.append(f"  near tie: {tie}{share}")
    if fork.a.batch and fork.b.batch and fork.a.batch != fork.b.batch:
        lines.append(f"  batches: A {fork.a.batch.describe()} | B {fork.b.batch.describe()}")
    if fork.culprit:
        lines.append(f"  culprit: {fork.culprit.describe()}")
    if fork.verdict_note:
        lines.append(f"  counterfactual: {fork.verdict_note}")
    elif fork.attribution in (sc.ATTRIBUTION_SAME_CACHE_PATH, sc.ATTRIBUTION_BATCH_COMPOSITION,
                              sc.ATTRIBUTION_OUTPUT_CANCELLED):
        lines.append(f"  {fork.note}")
    if fork.verdict is None and fork.replayable():
        lines.append(f"  prove it: {fork.replay_command()}")
    return "\n".join(lines) + "\n"


def _token(side: Side, position: int) -> str:
    if ended := side.ended_before(position):
        return f"nothing: {ended}"
    if side.token < 0:
        return "?"
    return f"{side.token} {side.text!r}" if side.text is not None else str(side.token)


def _margin(value: float) -> str:
    return "n/a" if value != value else f"{value:.4f}"
