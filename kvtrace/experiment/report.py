"""The experiment's report, computed only with the saved queries over the recorded runs."""

from __future__ import annotations

import collections
import math
from typing import Any, Optional, TextIO

from kvtrace import queries
from kvtrace.analysis.tables import print_rows
from kvtrace.experiment.plan import Plan
from kvtrace.experiment.runner import Outcome


def _num(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def divergence(client, plan: Plan) -> list[dict]:
    """One entry per compared pair of arms (cross-arm against ``off`` and within each arm)."""
    baseline = "off" if "off" in plan.arms else ""
    columns, rows = queries.run(client, "divergence_rates", {"run_prefix": plan.prefix + "/", "baseline_arm": baseline})
    found = [dict(zip(columns, row)) for row in rows]
    if baseline:
        # Within-arm noise floors of the other arms (repeats / orders of one arm against each other).
        columns, rows = queries.run(client, "divergence_rates", {"run_prefix": plan.prefix + "/", "baseline_arm": ""})
        found += [r for r in (dict(zip(columns, row)) for row in rows) if r["arm"] != baseline]
    pairs = []
    for r in found:
        pairs.append({
            "arm_a": r["arm"], "arm_b": r["compared_with"], "format": r["weight_format"],
            "runs": r["runs"], "pairs": r["pairs"],
            "n_episodes": r["episodes_compared"], "n_forked": r["episodes_forked"],
            "rate": _num(r["fork_rate"]), "ci95": [_num(r["ci_low"]), _num(r["ci_high"])],
            "median_fork_turn": _num(r["median_fork_turn"]),
            "median_fork_position": _num(r["median_fork_position"]),
            "mean_cached_tokens": _num(r["mean_cached_tokens"]),
        })
    return pairs


def attribution_counts(client, outcome: Outcome) -> dict[str, dict[str, int]]:
    """Fork attribution labels of every run against the ``off`` run of the same format/repeat/order."""
    off = {(r["format"], r["repeat"], r["order"]): r["run_id"] for r in outcome.runs if r["arm"] == "off"}
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    known = set(row[0] for row in queries.run(client, "runs")[1])
    for r in outcome.runs:
        baseline = off.get((r["format"], r["repeat"], r["order"]))
        if r["arm"] == "off" or not baseline or r["run_id"] not in known or baseline not in known:
            continue
        columns, rows = queries.run(client, "fork_attribution", {"run_a": r["run_id"], "run_b": baseline})
        for row in rows:
            counts[f"{r['format']}/{r['arm']}"][dict(zip(columns, row))["attribution"]] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(counts.items())}


def saved(client, name: str, plan: Plan) -> list[dict]:
    columns, rows = queries.run(client, name, {"run_prefix": plan.prefix + "/"})
    return [{c: _num(v) for c, v in zip(columns, row)} for row in rows]


def build_report(client, plan: Plan, outcome: Outcome) -> dict:
    return {
        "prefix": plan.prefix, "seed": plan.seed, "formats": list(plan.formats), "arms": list(plan.arms),
        "episodes": plan.episodes, "turns": plan.turns, "tokens": plan.tokens, "repeats": plan.repeats,
        "orders": list(plan.orders), "requests": outcome.requests, "seconds": round(outcome.seconds, 1),
        "interrupted": outcome.interrupted,
        "restore_checks": outcome.restore_checks, "restore_mismatches": outcome.restore_mismatches,
        "pairs": divergence(client, plan),
        "attribution": attribution_counts(client, outcome),
        "margin_shift": saved(client, "margin_shift", plan),
        "flip_rate_by_margin": saved(client, "flip_rate_by_margin", plan),
    }


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def print_report(report: dict, out: TextIO) -> None:

    if report["interrupted"]:
        out.write("interrupted: the table covers what was recorded before the stop\n")
    out.write(f"divergence (episodes that forked), {report['episodes']} episodes x {report['turns']} turns x "
              f"{report['tokens']} tokens, seed {report['seed']}:\n")
    cols = ("format", "arm", "vs", "episodes", "forked", "rate", "95% CI", "median fork turn/token", "cached tok/req")
    rows = []
    for p in report["pairs"]:
        turn, pos = p["median_fork_turn"], p["median_fork_position"]
        median = "-" if turn is None else f"{turn:g}/{pos:g}"
        rows.append((p["format"], p["arm_a"], p["arm_b"], p["n_episodes"], p["n_forked"], _pct(p["rate"]),
                     f"{_pct(p['ci95'][0])}-{_pct(p['ci95'][1])}", median,
                     "-" if p["mean_cached_tokens"] is None else f"{p['mean_cached_tokens']:.1f}"))
    print_rows(cols, rows, "text", out)
    if report["attribution"]:
        out.write("\nfork attribution against `off` (per format/arm):\n")
        for key, labels in report["attribution"].items():
            out.write(f"  {key}: " + ", ".join(f"{k} {v}" for k, v in labels.items()) + "\n")
    if report["margin_shift"]:
        out.write("\nmargin shift, cache hit - recompute (raw logits):\n")
        ms = report["margin_shift"]
        print_rows(tuple(ms[0]), [tuple(r.values()) for r in ms], "text", out)
    if report["flip_rate_by_margin"]:
        out.write("\ntop-1 flip rate by recompute margin:\n")
        fr = report["flip_rate_by_margin"]
        print_rows(tuple(fr[0]), [tuple(r.values()) for r in fr], "text", out)
    if report["restore_checks"]:
        bad = report["restore_mismatches"]
        out.write(f"\nrestore control: {report['restore_checks']} request(s) rerun from a saved state, "
                  f"{len(bad)} differed{': ' + ', '.join(bad[:5]) if bad else ' (each path is deterministic)'}\n")
    out.write(f"\n{report['requests']} requests in {report['seconds']:.0f} s\n")
