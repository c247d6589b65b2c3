"""The experiment harness on the real engine with the tiny generated model: `off` repeats agree
exactly, prefix reuse forks against `off` with every fork blamed on a cache event, a seed fixes
the results, and a two-format grid runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

from kvtrace.collectors.ingest import ingest_paths  # noqa: E402
from kvtrace.experiment import Plan, run_experiment  # noqa: E402
from kvtrace.experiment.models import generated_models  # noqa: E402
from kvtrace.experiment.report import build_report  # noqa: E402
from kvtrace.experiment.workload import episode_order, make_episodes  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402

CACHE_EVENTS = {"kvtrace.cache.reuse", "kvtrace.cache.restore", "kvtrace.cache.lookup"}


@pytest.fixture
def experiment(llama_patched, spool_recorder, spool_dir, db):
    def run(**overrides):
        params = dict(formats=("Q8_0",), arms=("off", "reuse"), episodes=24, turns=5, tokens=24, seed=3)
        params.update(overrides)
        plan = Plan(**params)
        outcome = run_experiment(plan, generated_models("tiny", plan.formats))
        spool_recorder.pipeline.force_flush()
        ingest_paths(db, [spool_dir])
        return plan, outcome, build_report(db, plan, outcome)

    return run


def pairs(report, arm_a, arm_b):
    return [p for p in report["pairs"] if (p["arm_a"], p["arm_b"]) == (arm_a, arm_b)]


def test_workload_is_a_function_of_the_seed():
    assert [e.opening() for e in make_episodes(5, 1)] == [e.opening() for e in make_episodes(5, 1)]
    assert [e.opening() for e in make_episodes(5, 1)] != [e.opening() for e in make_episodes(5, 2)]
    assert episode_order(6, "shuffled", 1) == episode_order(6, "shuffled", 1) != list(range(6))
    episode = make_episodes(1, 0)[0]
    assert "error: no tool call" in episode.observe("no call here", 0)
    assert "calc -> 12" in episode.observe("CALL calc(3 * 4)", 1)


def test_off_arm_repeats_are_bit_identical(experiment):
    _, outcome, report = experiment(arms=("off",), repeats=2, orders=("canonical", "shuffled"), episodes=12)
    within = pairs(report, "off", "off")
    assert len(within) == 1 and within[0]["n_forked"] == 0
    assert within[0]["pairs"] == 6  # 4 runs: every two of them compared, episode by episode
    assert within[0]["n_episodes"] == 6 * 12
    assert outcome.requests == 4 * 12 * 5


def test_reuse_forks_against_off_and_each_fork_has_a_culprit_cache_event(experiment, db):
    plan, _, report = experiment()
    (cross,) = pairs(report, "reuse", "off")
    assert cross["n_forked"] > 0, "this seed forks with prefix reuse on the tiny Q8_0 model"
    assert cross["ci95"][0] <= cross["rate"] <= cross["ci95"][1]
    assert cross["mean_cached_tokens"] > 0
    diff = diff_runs(db, plan.run_id("Q8_0", "reuse", 0, "canonical"), plan.run_id("Q8_0", "off", 0, "canonical"))
    assert len(diff.forks) == cross["n_forked"]
    for fork in diff.forks:
        assert fork.attribution == "hit_vs_recompute"
        assert fork.culprit is not None and fork.culprit.event in CACHE_EVENTS
    assert report["attribution"] == {"Q8_0/reuse": {"hit_vs_recompute": cross["n_forked"]}}


def test_same_seed_gives_the_same_results(experiment):
    def comparable(report):
        return json.dumps([{k: v for k, v in p.items() if k != "runs"} for p in report["pairs"]], sort_keys=True)

    _, _, first = experiment(prefix="first", episodes=12)
    _, _, second = experiment(prefix="second", episodes=12)
    assert comparable(first) == comparable(second)
    assert first["attribution"] == second["attribution"]


def test_a_two_format_grid_with_prompt_cache_and_restore_control(experiment):
    _, outcome, report = experiment(formats=("Q4_0", "Q8_0"), arms=("off", "prompt-cache", "restore"),
                                    episodes=6, turns=3)
    assert {p["format"] for p in report["pairs"]} == {"Q4_0", "Q8_0"}
    assert {(p["arm_a"], p["arm_b"]) for p in report["pairs"]} >= {("prompt-cache", "off"), ("restore", "off")}
    assert outcome.restore_checks == 2 * 6 * 3 and outcome.restore_mismatches == []
