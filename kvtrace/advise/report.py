"""The advice: per setting, how often each cache arm forked against ``off`` (the experiment's saved
divergence query: distinct episodes as n, Wilson intervals) and what the setting costs in speed, then
the cheapest setting that forked on no episode — with the upper end of its 95 % interval, since
0 forks in n episodes bounds the rate, it does not prove it zero.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Optional, TextIO

from kvtrace.advise.runner import Advice, SettingRun
from kvtrace.advise.speed import CLOCKS, PHASES
from kvtrace.analysis.tables import print_rows
from kvtrace.experiment.report import divergence

REFERENCE = {"speed_ratio": {f"{p}_{c}": 1.0 for p in PHASES for c in CLOCKS},
             "request_time_ratio": {c: 1.0 for c in CLOCKS}}
"""The baseline's own cost: every ratio is relative to it."""

RANK_CLOCK = "cpu"
"""Settings are ranked by CPU time: on a shared machine wall time also measures the neighbours."""


def _arm_rows(pairs: list[dict]) -> list[dict]:
    return [{"arm": p["arm_a"], "n_episodes": p["n_episodes"], "n_forked": p["n_forked"], "rate": p["rate"],
             "ci95": p["ci95"], "interval": p["interval"]} for p in pairs]


def _setting(run: SettingRun, pairs: list[dict], is_baseline: bool) -> dict:
    failure = run.outcome.failure
    cost = REFERENCE if is_baseline else (
        {"speed_ratio": run.cost.speed_ratio, "request_time_ratio": run.cost.request_time_ratio}
        if run.cost else None)
    arms = _arm_rows(pairs)
    complete = bool(arms) and run.crashed is None
    return {
        "name": run.candidate.name, "settings": run.candidate.settings.label,
        "engine": asdict(run.candidate.settings), "arms": arms,
        "zero_forks": complete and all(a["n_forked"] == 0 for a in arms),
        "rate_upper_95": max((a["ci95"][1] for a in arms if a["ci95"][1] is not None), default=None),
        "crashed": run.crashed, "crash_detail": failure.describe() if failure else run.speed_failure,
        "cost": cost, "speed_rounds": run.cost.rounds if run.cost else None,
    }


def recommend(settings: list[dict]) -> Optional[dict]:
    """The setting with no fork in any arm and the lowest request time (CPU); None when none."""
    clean = [s for s in settings if s["zero_forks"] and s["cost"] is not None]
    if not clean:
        return None
    return min(clean, key=lambda s: s["cost"]["request_time_ratio"][RANK_CLOCK])


def build_advice(client, advice: Advice, model: Path, weight_format: str) -> dict:
    plan, experiment = advice.plan, advice.plan.experiment
    pairs: dict[str, list[dict]] = {}
    for pair in divergence(client, experiment):  # every setting's runs share the prefix
        pairs.setdefault(pair["settings"], []).append(pair)
    settings = [_setting(run, pairs.get(run.candidate.settings.label, []), i == 0) for i, run in enumerate(advice.runs)]
    speeds = [run.cost.baseline_tokens_per_s for run in advice.runs if run.cost]
    best = recommend(settings)
    return {
        "model": str(model), "weight_format": weight_format, "prefix": experiment.prefix,
        "baseline": plan.candidates[0].settings.label,
        "workload": {"episodes": experiment.episodes, "turns": experiment.turns, "tokens": experiment.tokens,
                     "arms": list(experiment.arms), "seed": experiment.seed, "threads": experiment.n_threads},
        "speed_probe": {"prompt_tokens": plan.speed_spec(model, plan.candidates[0]).prompt_tokens,
                        "decode_tokens": plan.decode_tokens, "rounds": plan.speed_rounds, "ranked_by": RANK_CLOCK},
        "baseline_tokens_per_s": ({k: round(statistics.median(s[k] for s in speeds), 1) for k in speeds[0]}
                                  if speeds else None),
        "settings": settings,
        "recommendation": _recommendation(best, settings),
        "interrupted": advice.interrupted,
    }


def _forks(setting: dict) -> str:
    return ", ".join(f"{a['n_forked']}/{a['n_episodes']} forked with {a['arm']}" for a in setting["arms"])


def _recommendation(best: Optional[dict], settings: list[dict]) -> dict:
    if best is None:
        tried = [s for s in settings if s["arms"] and not s["crashed"]]
        fewest = min(tried, key=lambda s: max(a["rate"] or 0 for a in s["arms"]), default=None)
        text = "no setting tried forked on zero episodes in every arm" + (
            f"; the fewest forks: {fewest['name']} ({_forks(fewest)})" if fewest else "")
        return {"name": None, "settings": None, "text": text}
    cost = best["cost"]
    speed = cost["speed_ratio"]
    what = (f"keep the baseline ({best['settings']}):" if best is settings[0]
            else f"{best['name']} ({best['settings']}):")
    text = (f"{what} {_forks(best)}, so the fork rate is at most {best['rate_upper_95']:.1%} at 95 % confidence; "
            f"time per request x{cost['request_time_ratio']['cpu']:.2f} CPU (x{cost['request_time_ratio']['wall']:.2f} "
            f"wall), prefill speed x{speed['prefill_cpu']:.2f}, decode speed x{speed['decode_cpu']:.2f} (CPU)")
    return {"name": best["name"], "settings": best["settings"], "rate_upper_95": best["rate_upper_95"], "text": text}


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0%}" if value == 0 or value >= 0.1 else f"{value:.1%}"


def _arm_cell(arm: Optional[dict]) -> str:
    if arm is None:
        return "-"
    low, high = arm["ci95"]
    return f"{arm['n_forked']}/{arm['n_episodes']} {_pct(arm['rate'])} ({_pct(low)}-{_pct(high)})"


def _ratio_cell(cost: Optional[dict], key: str) -> str:
    if cost is None:
        return "-"
    ratios = cost["speed_ratio"] if key in PHASES else cost["request_time_ratio"]
    if key in PHASES:
        return f"{ratios[f'{key}_wall']:.2f} / {ratios[f'{key}_cpu']:.2f}"
    return f"{ratios['wall']:.2f} / {ratios['cpu']:.2f}"


def print_advice(report: dict, out: TextIO) -> None:
    work = report["workload"]
    if report["interrupted"]:
        out.write("interrupted: the table covers the settings that ran before the stop\n")
    out.write(f"{report['model']} ({report['weight_format']}): forks against `off` per cache arm, "
              f"{work['episodes']} episodes x {work['turns']} turns x {work['tokens']} tokens, seed {work['seed']}; "
              f"speed relative to the baseline {report['baseline']}:\n")
    arms = list(dict.fromkeys(a["arm"] for s in report["settings"] for a in s["arms"]))
    columns = ("setting", "engine settings", *(f"{arm}: forked (95% CI)" for arm in arms),
               "prefill x wall/cpu", "decode x wall/cpu", "time/request x wall/cpu")
    rows = []
    for s in report["settings"]:
        found = {a["arm"]: a for a in s["arms"]}
        if s["crashed"]:
            cells = [f"crashed: engine {s['crashed']}"] + ["-"] * (len(arms) - 1) if arms else []
        else:
            cells = [_arm_cell(found.get(arm)) for arm in arms]
        rows.append((s["name"], s["settings"], *cells, *(_ratio_cell(s["cost"], k) for k in (*PHASES, "request"))))
    print_rows(columns, rows, "text", out)
    probe, base = report["speed_probe"], report["baseline_tokens_per_s"]
    speeds = (f" (baseline: prefill {base['prefill_wall']:.0f} tok/s, decode {base['decode_wall']:.0f} tok/s wall)"
              if base else "")
    out.write(f"n counts distinct episodes (Wilson interval). Speed x: the setting's tokens/s over the baseline's"
              f"{speeds}, timed in pairs in one process, {probe['rounds']} rounds of a {probe['prompt_tokens']}-token "
              f"prefill and {probe['decode_tokens']} decode steps in alternating order, median of the per-round "
              f"ratios; wall clock next to process CPU time (others share the machine); ranked by CPU time.\n")
    for s in report["settings"]:
        if s["crashed"]:
            out.write(f"{s['name']}: {s['crash_detail']}\n")
    out.write(f"\nrecommendation: {report['recommendation']['text']}\n")
