"""The experiment's report, computed only with the saved queries over the recorded runs.

Everything is counted per distinct episode: runs that repeated an episode bit for bit are one
observation of it (``divergence_rates`` collapses them), repeats that differ are reported as a finding
of their own (nondeterminism outside the cache), fork attribution counts forked episodes, and the
restore control is a check (reproduced / checked), not an arm.
"""

from __future__ import annotations

import collections
import json
import math
from typing import Any, Optional, TextIO

from kvtrace import queries
from kvtrace.analysis.forks import diff_runs
from kvtrace.analysis.tables import print_rows
from kvtrace.errors import EngineFailed
from kvtrace.experiment.plan import CONTROL_ARM, EngineSettings, Plan, VllmSettings, format_bytes
from kvtrace.experiment.runner import Outcome

BASELINE_ARM = "off"


def _num(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def settings_label(numerics_settings: str) -> str:
    """The engine settings a request recorded, spelled as in run ids (``b256.ub1.fa-off.kv-f16``; vLLM's
``eager`` or ``eager.batch-8``)."""
    try:
        n = json.loads(numerics_settings)
        if "enforce_eager" in n:  # vLLM's
            return VllmSettings(bool(n["enforce_eager"]), int(n.get("max_num_seqs") or 1)).label
        return EngineSettings(int(n["n_batch"]), int(n["n_ubatch"]), "on" if n["flash_attn"] == "enabled" else "off",
                              str(n["type_k"]), "on" if n.get("weight_repack") else "off").label
    except (ValueError, KeyError, TypeError):
        return numerics_settings or "-"


def cache_label(cache_settings: str) -> str:
    """The prompt cache's capacity a request recorded (``1GiB``), or "" without a prompt cache."""
    try:
        capacity = json.loads(cache_settings).get("capacity_bytes")
    except (ValueError, AttributeError):
        return ""
    return format_bytes(int(capacity)) if capacity is not None else ""


def _rate_row(r: dict) -> dict:
    cache = cache_label(r["cache_settings"])
    return {
        "format": r["weight_format"], "settings": settings_label(r["numerics_settings"]),
        "kv_cache_type": r["kv_cache_type"], "arm": r["arm"], "cache": cache,
        "arm_a": f"{r['arm']}-{cache}" if cache else r["arm"], "arm_b": r["compared_with"],
        "runs": r["runs"], "compared_runs": r["compared_runs"],
        "n_episodes": r["episodes_compared"], "samples": r["samples"], "n_forked": r["episodes_forked"],
        "rate": _num(r["fork_rate"]), "ci95": [_num(r["ci_low"]), _num(r["ci_high"])],
        "interval": r["interval_method"],
        "median_fork_turn": _num(r["median_fork_turn"]), "median_fork_position": _num(r["median_fork_position"]),
        "mean_cached_tokens": _num(r["mean_cached_tokens"]),
    }


def _rates(client, plan: Plan, baseline: str) -> list[dict]:
    columns, rows = queries.run(client, "divergence_rates", {"run_prefix": plan.prefix + "/", "baseline_arm": baseline})
    found = [_rate_row(dict(zip(columns, row))) for row in rows]
    return sorted((r for r in found if CONTROL_ARM not in (r["arm"], r["arm_b"])), key=lambda r: _plan_order(plan, r))


def _plan_order(plan: Plan, row: dict) -> tuple:
    """Rows in the order the plan names formats, engine settings, arms and cache sizes."""
    def index(values: list, value) -> int:
        return values.index(value) if value in values else len(values)

    return (index(list(plan.formats), row["format"]), index([s.label for s in plan.engine_settings()], row["settings"]),
            index(list(plan.arms), row["arm"]), index([format_bytes(c) for c in plan.cache_ram], row["cache"]),
            row["format"], row["settings"], row["arm_a"])


def divergence(client, plan: Plan) -> list[dict]:
    """One entry per arm (and cache size) against ``off``, per format and engine setting."""
    return _rates(client, plan, BASELINE_ARM) if BASELINE_ARM in plan.arms else []


def repeat_agreement(client, plan: Plan) -> list[dict]:
    """Per configuration with several runs in one order: on how many episodes its repeats differ."""
    return _rates(client, plan, "")


def attribution_counts(client, outcome: Outcome) -> dict[str, dict[str, Any]]:
    """Fork attribution labels per forked episode, against the ``off`` run of the same format, engine
    setting, repeat and order (or any ``off`` run of that format and setting). An episode counts once
    per label however many repeats or orders forked it the same way."""
    baseline: dict[tuple, str] = {}
    for r in outcome.runs:
        if r["arm"] == BASELINE_ARM:
            baseline.setdefault((r["format"], r["settings"], r["repeat"], r["order"]), r["run_id"])
            baseline.setdefault((r["format"], r["settings"]), r["run_id"])
    known = set(row[0] for row in queries.run(client, "runs")[1])
    labels: dict[str, dict[str, set]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for r in outcome.runs:
        off = (baseline.get((r["format"], r["settings"], r["repeat"], r["order"]))
               or baseline.get((r["format"], r["settings"])))
        if r["arm"] == BASELINE_ARM or not off or r["run_id"] not in known or off not in known:
            continue
        arm = r["arm"] if r["cache_ram"] is None else f"{r['arm']}-{format_bytes(r['cache_ram'])}"
        key = f"{r['format']}/{r['settings']}/{arm}"
        columns, rows = queries.run(client, "fork_attribution", {"run_a": r["run_id"], "run_b": off})
        for row in rows:
            fork = dict(zip(columns, row))
            labels[key][fork["attribution"]].add(fork["episode_id"])
    out = {}
    for key in sorted(labels):
        episodes = set().union(*labels[key].values())
        out[key] = {"forked_episodes": len(episodes),
                    "labels": {label: len(eps) for label, eps in sorted(labels[key].items())}}
    return out


def batching_effect(client, outcome: Outcome) -> list[dict]:
    """Per format and arm, each ``--batch`` above one against one request at a time (first repeat, first
    order of each): episodes whose trajectories forked, of those compared, with their Wilson interval (n:
    episodes), and the forks' labels (docs/batching.md). The cache effect is the rest of the report."""
    single: dict[tuple, dict] = {}
    for r in outcome.runs:
        if r.get("batch", 1) == 1 and r["repeat"] == 0:
            single.setdefault((r["format"], r["arm"], r["cache_ram"]), r)
    known = set(row[0] for row in queries.run(client, "runs")[1])
    out = []
    for r in outcome.runs:
        base = single.get((r["format"], r["arm"], r["cache_ram"]))
        if base is None or r.get("batch", 1) == 1 or r["repeat"] != 0 or r["order"] != base["order"]:
            continue
        if r["run_id"] not in known or base["run_id"] not in known:
            continue
        diff = diff_runs(client, r["run_id"], base["run_id"])
        labels = collections.Counter(f.attribution for f in diff.forks)
        n, k = diff.episodes_compared, len(diff.forks)
        out.append({"format": r["format"], "arm": r["arm"], "batch": r["batch"], "run_id": r["run_id"],
                    "compared_with": base["run_id"], "n_episodes": n, "n_forked": k,
                    "rate": k / n if n else None, "ci95": list(wilson(k, n)) if n else [None, None],
                    "labels": dict(sorted(labels.items()))})
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of k successes in n independent samples."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def saved(client, name: str, plan: Plan) -> list[dict]:
    columns, rows = queries.run(client, name, {"run_prefix": plan.prefix + "/"})
    return [{c: _num(v) for c, v in zip(columns, row)} for row in rows]


def flip_rates(client, plan: Plan) -> list[dict]:
    rows = saved(client, "flip_rate_by_margin", plan)
    for row in rows:
        row["settings"] = settings_label(row.pop("numerics_settings")) if row["kv_cache_type"] else ""
    return rows


def report_after_passes(client, plan: Plan, outcome: Outcome) -> dict:
    """The report of the passes, read from ``client`` once their spool is ingested (so a pass that died
    still leaves what it recorded stored); EngineFailed for that dead pass."""
    if outcome.failure is not None:
        raise EngineFailed(outcome.failure.describe())
    return build_report(client, plan, outcome)


def build_report(client, plan: Plan, outcome: Outcome) -> dict:
    return {
        "prefix": plan.prefix, "engine": plan.engine, "seed": plan.seed, "formats": list(plan.formats), "arms": list(plan.arms),
        "episodes": plan.episodes, "turns": plan.turns, "tokens": plan.tokens, "repeats": plan.repeats,
        "orders": list(plan.orders), "conversation": plan.conversation, "schedule": plan.schedule,
        "engine_settings": [s.label for s in plan.engine_settings()],
        "cache_ram": [format_bytes(c) for c in plan.cache_ram],
        "requests": outcome.requests, "seconds": round(outcome.seconds, 1), "interrupted": outcome.interrupted,
        "peak_rss_bytes": outcome.peak_rss_bytes,
        "runs": outcome.runs,
        "control": {"arm": CONTROL_ARM, "checked": outcome.restore_checks,
                    "reproduced": outcome.restore_checks - len(outcome.restore_mismatches),
                    "mismatches": outcome.restore_mismatches},
        "pairs": divergence(client, plan),
        "repeat_agreement": repeat_agreement(client, plan),
        "attribution": attribution_counts(client, outcome),
        "margin_shift": saved(client, "margin_shift", plan),
        "flip_rate_by_margin": flip_rates(client, plan),
        "batching": batching_effect(client, outcome),
    }


def _pct(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1%}" if 0.0005 <= value < 0.1 else f"{value:.0%}"


def _interval(ci: list) -> str:
    return f"{_pct(ci[0])}-{_pct(ci[1])}"


def print_report(report: dict, out: TextIO) -> None:

    if report["interrupted"]:
        out.write("interrupted: the table covers what was recorded before the stop\n")
    out.write(f"divergence against `off`: episodes that forked, {report['episodes']} episodes x {report['turns']} "
              f"turns x {report['tokens']} tokens, seed {report['seed']}, conversation {report['conversation']}, "
              f"schedule {report['schedule']}:\n")
    cols = ("format", "engine settings", "arm", "episodes", "forked", "rate", "95% CI", "interval",
            "median fork turn/token", "cached tok/req")
    rows = []
    for p in report["pairs"]:
        turn, pos = p["median_fork_turn"], p["median_fork_position"]
        interval = p["interval"] if p["samples"] == p["n_episodes"] else f"{p['interval']} ({p['samples']} samples)"
        rows.append((p["format"], p["settings"], p["arm_a"], p["n_episodes"], p["n_forked"], _pct(p["rate"]),
                     _interval(p["ci95"]), interval, "-" if turn is None else f"{turn:g}/{pos:g}",
                     "-" if p["mean_cached_tokens"] is None else f"{p['mean_cached_tokens']:.1f}"))
    print_rows(cols, rows, "text", out)
    out.write("n counts distinct episodes: runs that repeat an episode bit for bit count once. wilson: one "
              "yes/no per episode; cluster bootstrap: an episode has several distinct samples (orders or "
              "repeats that differ), resampled by episode.\n")
    if report["repeat_agreement"]:
        out.write("\nrepeats (same arm, same episode order):\n")
        for p in report["repeat_agreement"]:
            what = (f"identical on all {p['n_episodes']} episodes" if not p["n_forked"] else
                    f"differ on {p['n_forked']}/{p['n_episodes']} episodes ({_interval(p['ci95'])}): "
                    f"nondeterminism outside the cache")
            out.write(f"  {p['format']} {p['settings']} {p['arm_a']}: {p['runs']} runs, {what}\n")
    if report["attribution"]:
        out.write("\nfork attribution against `off`, per forked episode:\n")
        for key, found in report["attribution"].items():
            out.write(f"  {key}: {found['forked_episodes']} forked episode(s): "
                      + ", ".join(f"{k} {v}" for k, v in found["labels"].items()) + "\n")
    if report.get("batching"):
        out.write("\nbatching against one request at a time (same arm), episodes that forked:\n")
        for b in report["batching"]:
            labels = ", ".join(f"{k} {v}" for k, v in b["labels"].items()) or "-"
            out.write(f"  {b['format']} {b['arm']} batch {b['batch']}: {b['n_forked']}/{b['n_episodes']} "
                      f"({_pct(b['rate'])}, 95% CI {_interval(b['ci95'])}, wilson); labels: {labels}\n")
    if report["margin_shift"]:
        out.write("\nmargin shift, cache hit - recompute (raw logits):\n")
        ms = report["margin_shift"]
        print_rows(tuple(ms[0]), [tuple(r.values()) for r in ms], "text", out)
    if report["flip_rate_by_margin"]:
        out.write("\ntop-1 flip rate by recompute margin (each distinct position once):\n")
        cols = ("format", "engine settings", "margin", "episodes", "positions", "flips", "rate", "95% CI", "interval")
        print_rows(cols, [(r["weight_format"], r["settings"] or "-", r["margin_bin"], r["episodes"], r["positions"],
                           r["flips"], _pct(r["flip_rate"]), _interval([r["ci_low"], r["ci_high"]]),
                           r["interval_method"]) for r in report["flip_rate_by_margin"]], "text", out)
    control = report["control"]
    if control["checked"]:
        bad = control["mismatches"]
        verdict = ": differed " + ", ".join(bad[:5]) if bad else " (each cache path is deterministic)"
        out.write(f"\nrestore control: {control['reproduced']:,}/{control['checked']:,} requests reproduced from a "
                  f"saved state{verdict}\n")
    peak = report["peak_rss_bytes"]
    out.write(f"\n{report['requests']:,} requests in {report['seconds']:.0f} s"
              + (f"; peak resident memory of an engine pass {peak / 2**20:.0f} MiB" if peak else "") + "\n")
