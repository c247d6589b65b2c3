"""Alerting on cache-path margin shift.  A production server's cache hits on its Q4_K_M model start
moving margins by 0.25 logits while its F16 model stays within 0.01: the margin-shift rule fires for
Q4_K_M only, its webhook and Alertmanager hear about it, and once the window has passed without more
shifted hits both hear it resolved.  Exit codes say firing / all clear / could not evaluate."""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager

import pytest
import yaml

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import semconv as sc
from kvtrace.cli import main
from readme_commands import ROOT, readme_kvtrace_args
from receivers import Receiver

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
TOKENS = [10, 11, 12, 13]
REFERENCE = [1.0, 0.5, 0.3, 2.0]
HIT = CachePath(sc.LAYER_KV_REUSE, 8, event=sc.EVENT_CACHE_REUSE)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("alerts")
    book = ScenarioBook(root / "spool")
    # F16's third position is a near tie on both paths (0.03, 0.04 with the hit's shift).
    for fmt, shift, reference in (("Q4_K_M", 0.25, REFERENCE), ("F16", 0.01, [1.0, 0.5, 0.03, 2.0])):
        for e in range(3):  # recomputes first: they are the reference of every prompt
            book.turn(f"prod-off-{fmt}", f"e{e}", 0, PROMPT + [e], TOKENS, reference, arm="off", weight_format=fmt)
        for e in range(3):
            book.turn(f"prod-hit-{fmt}", f"e{e}", 0, PROMPT + [e], TOKENS, [m + shift for m in reference], cache=HIT,
                      arm="reuse", weight_format=fmt)
    url = f"chdb://{root / 'db'}"
    client = connect(url)
    init_schema(client)
    book.ingest(client)
    client.close()  # an embedded database is one process's at a time, and `kvtrace alert --watch` opens it in another
    return {"url": url, "spool": str(root / "spool"), "root": root}


@contextmanager
def opened(recorded):
    from kvtrace.db import connect

    client = connect(recorded["url"])
    try:
        yield client
    finally:
        client.close()


def write_rules(path, rules, delivery=None):
    document = {"rules": rules, **({"delivery": delivery} if delivery else {})}
    path.write_text(yaml.dump(document, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    return path


SHIFT_RULE = {"name": "margin-shift-p95", "metric": "margin_shift_p95_abs", "threshold": 0.1, "window": "30m",
              "min_samples": 4}


def kvtrace(recorded, tmp_path, *args):
    return main(["--db", recorded["url"], "--spool-dir", recorded["spool"], "-q", "alert",
                 "--state", str(tmp_path / "state.json"), *args])


def test_margin_shift_rule_fires_above_its_threshold_and_stays_quiet_below(recorded):
    from kvtrace.alerts.evaluation import evaluate
    from kvtrace.alerts.rules import parse_config

    now = time.time()
    config = parse_config({"rules": [SHIFT_RULE, {**SHIFT_RULE, "name": "lenient", "threshold": 0.3},
                                     {**SHIFT_RULE, "name": "mean", "metric": "margin_shift_mean_abs"}]})
    with opened(recorded) as client:
        strict, lenient, mean = evaluate(client, config, now).outcomes
    assert [a.labels["weight_format"] for a in strict.firing] == ["Q4_K_M"]
    assert strict.firing[0].value == pytest.approx(0.25)
    assert strict.firing[0].samples == 12 and strict.rows == 2  # both formats judged, one fired
    assert lenient.firing == [] and lenient.rows == 2
    assert [a.labels["weight_format"] for a in mean.firing] == ["Q4_K_M"]


def test_filters_min_samples_and_window_scope_a_rule(recorded):
    from kvtrace.alerts.evaluation import evaluate
    from kvtrace.alerts.rules import parse_config

    now = time.time()
    rules = [
        {**SHIFT_RULE, "name": "f16-only", "filters": {"weight_format": "F16"}, "threshold": 0.005},
        {**SHIFT_RULE, "name": "too-few", "min_samples": 1000},
        {"name": "near-ties", "metric": "near_tie_share", "threshold": 0.2, "window": "1h"},
        {"name": "forks", "metric": "divergence_rate", "threshold": 0.5, "baseline_arm": "off", "window": "1h"},
    ]
    with opened(recorded) as client:
        outcomes = evaluate(client, parse_config({"rules": rules}), now).outcomes
        later = evaluate(client, parse_config({"rules": rules}), now + 7200).outcomes
    f16, too_few, ties, forks = outcomes
    assert [a.value for a in f16.firing] == [pytest.approx(0.01)]
    assert (too_few.firing, too_few.rows) == ([], 0)
    assert [(a.labels["weight_format"], a.value) for a in ties.firing] == [("F16", 0.25)]
    assert forks.firing == [] and forks.rows == 2 and not forks.error  # same tokens: no episode forked
    assert all(o.firing == [] and o.rows == 0 for o in later)


def test_webhook_and_alertmanager_hear_firing_then_resolved(recorded, tmp_path, capsys):
    with Receiver() as hook, Receiver() as manager:
        rules = write_rules(tmp_path / "rules.yaml", [SHIFT_RULE],
                            {"webhook": {"url": f"{hook.url}/kvtrace"}, "alertmanager": {"url": manager.url}})
        assert kvtrace(recorded, tmp_path, "--rules", str(rules)) == 1
        assert "FIRING   margin-shift-p95" in capsys.readouterr().out
        ((path, body),) = hook.take()
        assert path == "/kvtrace" and body["status"] == "firing"
        (alert,) = body["alerts"]
        assert alert["labels"]["alertname"] == "margin-shift-p95" and alert["labels"]["weight_format"] == "Q4_K_M"
        ((path, posted),) = manager.take()
        assert path == "/api/v2/alerts" and "endsAt" not in posted[0]
        assert posted[0]["labels"] == alert["labels"] and posted[0]["startsAt"] == alert["startsAt"]

        # Still firing: the Alertmanager is kept up to date, the webhook is not told twice.
        assert kvtrace(recorded, tmp_path, "--rules", str(rules)) == 1
        assert hook.take() == [] and len(manager.take()) == 1

        # Two hours later the window holds no shifted hits: resolved, to both.
        assert kvtrace(recorded, tmp_path, "--rules", str(rules), "--at", str(time.time() + 7200)) == 0
        out = capsys.readouterr().out
        assert "RESOLVED margin-shift-p95" in out
        ((_, body),) = hook.take()
        assert body["status"] == "resolved" and body["alerts"][0]["status"] == "resolved"
        ((_, posted),) = manager.take()
        assert posted[0]["labels"] == alert["labels"] and posted[0]["endsAt"] > posted[0]["startsAt"]
        assert json.loads((tmp_path / "state.json").read_text())["alerts"] == {}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_delivery_is_reported_retried_and_sent_later(recorded, tmp_path, capsys):
    dead = f"http://127.0.0.1:{closed_port()}"
    rules = write_rules(tmp_path / "rules.yaml", [SHIFT_RULE],
                        {"webhook": {"url": dead}, "attempts": 2, "retry_delay": 0})
    assert kvtrace(recorded, tmp_path, "--rules", str(rules)) == 1  # the evaluation stands
    err = capsys.readouterr().err
    assert "webhook delivery failed" in err and "after 2 attempt(s)" in err
    with Receiver() as hook:
        write_rules(rules, [SHIFT_RULE], {"webhook": {"url": hook.url}})
        assert kvtrace(recorded, tmp_path, "--rules", str(rules), "--watch", "0.01", "--cycles", "2") == 1
        posts = hook.take()
        assert len(posts) == 1 and posts[0][1]["status"] == "firing"  # the pending notice, once


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_watching_for_hours_does_not_pile_up_descriptors(recorded, tmp_path, capsys):
    """chDB keeps some threads and descriptors of every database opened and closed in a process: a watch
    that opened it itself every cycle would run out of descriptors after some hours."""
    with Receiver() as hook:
        rules = write_rules(tmp_path / "rules.yaml", [SHIFT_RULE], {"webhook": {"url": hook.url}})
        before = open_descriptors()
        assert kvtrace(recorded, tmp_path, "--rules", str(rules), "--watch", "0.01", "--cycles", "2") == 1
        after_2 = open_descriptors()
        assert kvtrace(recorded, tmp_path, "--rules", str(rules), "--watch", "0.01", "--cycles", "4") == 1
        after_6 = open_descriptors()
        assert after_6 - after_2 <= 2 and after_2 - before <= 2, (before, after_2, after_6)
        out = capsys.readouterr().out
        assert out.count("FIRING   margin-shift-p95") == 6  # every cycle evaluated, in its own process
        posts = hook.take()
        assert [body["status"] for _, body in posts] == ["firing"]  # the state carried from cycle to cycle
        # Two hours later (one evaluation, from cron) the same state file resolves it.
        assert kvtrace(recorded, tmp_path, "--rules", str(rules), "--at", str(time.time() + 7200)) == 0
        assert "RESOLVED margin-shift-p95" in capsys.readouterr().out
        assert [body["status"] for _, body in hook.take()] == ["resolved"]


def test_exit_codes(recorded, tmp_path, capsys):
    quiet = write_rules(tmp_path / "quiet.yaml", [{**SHIFT_RULE, "threshold": 5.0}])
    assert kvtrace(recorded, tmp_path, "--rules", str(quiet)) == 0
    assert "all clear" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: x\n    metric: margin_vibes\n    threshold: 1\n")
    assert kvtrace(recorded, tmp_path, "--rules", str(bad)) == 2
    assert "metric 'margin_vibes' is not one of" in capsys.readouterr().err
    assert kvtrace(recorded, tmp_path, "--rules", str(tmp_path / "missing.yaml")) == 2
    unreachable = main(["--db", f"http://127.0.0.1:{closed_port()}/default", "-q", "alert", "--rules", str(quiet),
                        "--state", str(tmp_path / "s2.json")])
    assert unreachable == 2
    assert "could not evaluate rule margin-shift-p95" in capsys.readouterr().err


def test_the_example_rules_evaluate_as_the_readme_shows_and_stay_quiet_below_their_sample_floors(
        recorded, tmp_path, capsys, monkeypatch):
    """Every example rule's query runs on the recorded shifts; they rest on too few samples for any rule's
    min_samples (200 positions, 20 episodes, 500 decisions), so nothing fires and nothing is delivered."""
    monkeypatch.chdir(ROOT)  # README's command names the example rules relative to the clone
    alert = readme_kvtrace_args("kvtrace alert --rules examples/alert-rules.yaml")
    assert main(["--db", recorded["url"], "--spool-dir", recorded["spool"], "-q", *alert,
                 "--state", str(tmp_path / "state.json")]) == 0
    assert "all clear" in capsys.readouterr().out


def test_the_example_rules_file_is_valid():
    from pathlib import Path

    from kvtrace.alerts.rules import load_rules

    config = load_rules(Path(__file__).resolve().parent.parent / "examples" / "alert-rules.yaml")
    assert [r.metric for r in config.rules] == ["margin_shift_p95_abs", "margin_shift_mean_abs",
                                                "shadow_margin_shift_p95_abs", "divergence_rate", "divergence_rate",
                                                "near_tie_share"]
    assert [r.baseline_arm for r in config.rules if r.metric == "divergence_rate"] == ["off", "shadow"]
    assert config.rules[0].window_s == 1800 and config.delivery.alertmanager.ends_after_s == 900


class CountingClient:
    """The real database client, counting the queries sent through it."""

    def __init__(self, client):
        self.client, self.queries = client, 0

    def query(self, *args, **kwargs):
        self.queries += 1
        return self.client.query(*args, **kwargs)


def many_rules(count: int) -> list[dict]:
    """``count`` rules over every metric and two windows, with thresholds, labels and the filters the
    queries answer row by row all different."""
    formats = ("Q4_K_M", "F16", None)
    rules = []
    for i in range(count):
        metric = ("margin_shift_p95_abs", "margin_shift_mean_abs", "near_tie_share", "divergence_rate")[i % 4]
        rule = {"name": f"rule-{i}", "metric": metric, "threshold": (i % 50) / 100, "window": ("30m", "1h")[i % 3 % 2],
                "min_samples": 1 + i % 7, "labels": {"team": f"t{i % 13}"}}
        fmt = formats[i % 5 % 3]
        if fmt and metric != "divergence_rate":
            rule["filters"] = {"weight_format": fmt}
        if metric == "near_tie_share" and i % 2:
            rule["filters"] = {**rule.get("filters", {}), "engine": "llama.cpp"}
        if metric == "divergence_rate":
            rule["baseline_arm"] = "off"
        rules.append(rule)
    return rules


def test_ten_thousand_rules_ask_each_question_once_and_judge_as_each_rule_alone(recorded):
    from kvtrace import queries
    from kvtrace.alerts.evaluation import evaluate, judge
    from kvtrace.alerts.rules import parse_config

    now = time.time()
    config = parse_config({"rules": many_rules(10_000)})
    with opened(recorded) as client:
        counting = CountingClient(client)
        outcomes = evaluate(counting, config, now).outcomes
        # Three saved queries (the two margin-shift metrics share one) over two windows.
        assert counting.queries == 6
        assert not [o for o in outcomes if o.error]
        for rule, outcome in list(zip(config.rules, outcomes))[::397]:  # each rule's own query, filters in it
            columns, rows = queries.run(client, rule.measure.query, rule.query_params(now - rule.window_s, now))
            alone = judge(rule, [dict(zip(columns, row)) for row in rows])
            assert (outcome.rows, [(a.labels, a.value) for a in outcome.firing]) == \
                (alone.rows, [(a.labels, a.value) for a in alone.firing]), rule.name
    fired = {o.rule.name for o in outcomes if o.firing}
    assert "rule-0" in fired and "rule-40" not in fired  # p95 shift 0.25 over 0.0; no rule fires over 0.4
    assert any(o.rows and not o.firing for o in outcomes) and len(fired) > 1000


def test_ten_thousand_rules_from_the_command_line(recorded, tmp_path, capsys):
    rules = write_rules(tmp_path / "rules.yaml", many_rules(10_000))
    assert kvtrace(recorded, tmp_path, "--rules", str(rules)) == 1
    out = capsys.readouterr().out
    state = json.loads((tmp_path / "state.json").read_text())["alerts"]
    assert out.count(" FIRING   ") == len(state) > 1000


def test_a_webhook_that_redirects_has_not_heard_the_alert(recorded, tmp_path, capsys):
    from test_alert_delivery import Server

    target = Server()
    redirecting = Server(302, target.url)
    try:
        rules = write_rules(tmp_path / "rules.yaml", [SHIFT_RULE],
                            {"webhook": {"url": f"{redirecting.url}/hook/T0K3N"}, "attempts": 2, "retry_delay": 0})
        assert kvtrace(recorded, tmp_path, "--rules", str(rules)) == 1
        err = capsys.readouterr().err
        assert f"webhook delivery failed: {redirecting.url}/…: HTTP 302 Found" in err and "T0K3N" not in err
        assert target.requests == [] and len(redirecting.requests) == 2
        (tracked,) = json.loads((tmp_path / "state.json").read_text())["alerts"].values()
        assert tracked["pending"] == ["webhook"]  # told again at the next evaluation
    finally:
        target.close()
        redirecting.close()
