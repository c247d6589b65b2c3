"""``kvtrace alert`` against a real Prometheus Alertmanager (Debian's ``prometheus-alertmanager``).

The story: two hours ago a production server's Q4_K_M cache hits moved margins by 0.25 logits.
An evaluation of that window fires the margin-shift rule; the Alertmanager, configured with the
route from ``examples/alertmanager.yml``, lists the alert as active on that route's receiver and
notifies the receiver.  Evaluated again for the same window, the alert is kept alive, not
duplicated.  Evaluated now, the window holds no shifted hits: kvtrace sends it resolved, the
Alertmanager drops it from its active alerts and tells the receiver it resolved.  Everything is
read from the Alertmanager's own API and its own notifications, not from what kvtrace posted.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import semconv as sc
from kvtrace.cli import main
from kvtrace.experiment.server import stop_server
from receivers import Receiver

EXAMPLE_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "alertmanager.yml"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
TOKENS = [10, 11, 12, 13]
REFERENCE = [1.0, 0.5, 0.3, 2.0]
HIT = CachePath(sc.LAYER_KV_REUSE, 8, event=sc.EVENT_CACHE_REUSE)
RULE = {"name": "margin-shift-p95", "metric": "margin_shift_p95_abs", "threshold": 0.1, "window": "30m",
        "min_samples": 4}
SHADOW_RULE = {"name": "live-margin-shift-p95", "metric": "shadow_margin_shift_p95_abs", "threshold": 0.1,
               "window": "30m", "min_samples": 3}
"""On live traffic: hits against the cold twins `kvtrace proxy --shadow` sent of them, over 3 episodes."""
TWO_HOURS_AGO = time.time() - 7200
STARTUP_S = 30
NOTIFY_S = 30


def alertmanager_binary() -> str:
    """Debian installs the Alertmanager as ``prometheus-alertmanager``; upstream's binary is ``alertmanager``."""
    for name in ("prometheus-alertmanager", "alertmanager"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Alertmanager binary (apt-get install prometheus-alertmanager)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def oncall():
    """The webhook receiver the example route notifies."""
    with Receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def alertmanager(oncall, tmp_path_factory):
    """A real Alertmanager on a loopback port: the example config, its receiver pointed at ``oncall`` and its
    grouping waits shortened from minutes to a second, a throwaway storage dir and no clustering."""
    binary = alertmanager_binary()
    root = tmp_path_factory.mktemp("alertmanager")
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    (route,) = config["route"]["routes"]
    (receiver,) = [r for r in config["receivers"] if r["name"] == route["receiver"]]
    receiver["webhook_configs"][0]["url"] = f"{oncall.url}/kvtrace-alerts"
    route.update(group_wait="0s", group_interval="1s")
    (root / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = root / "alertmanager.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={root / 'alertmanager.yml'}", f"--storage.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Alertmanager did not become ready:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield {"url": url, "receiver": route["receiver"]}
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Recompute and cache-hit requests of Q4_K_M two hours ago, the hits 0.25 logits off."""
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("shifted")
    book = ScenarioBook(root / "spool")
    for e in range(3):
        book.turn("prod-off", f"e{e}", 0, PROMPT + [e], TOKENS, REFERENCE, arm="off", weight_format="Q4_K_M",
                  at=TWO_HOURS_AGO)
    for e in range(3):
        book.turn("prod-hit", f"e{e}", 0, PROMPT + [e], TOKENS, [m + 0.25 for m in REFERENCE], cache=HIT,
                  arm="reuse", weight_format="Q4_K_M", at=TWO_HOURS_AGO + 1)
    client = connect(f"chdb://{root / 'db'}")
    init_schema(client)
    book.ingest(client)
    client.close()
    return {"url": f"chdb://{root / 'db'}", "spool": str(root / "spool")}


@pytest.fixture(scope="module")
def shadowed(tmp_path_factory):
    """Live Q4_K_M cache hits two hours ago, each followed by its shadow twin (arm ``shadow``, recomputed),
    the hits 0.25 logits off their twins; an earlier canary recomputed the same prompts with the hits'
    very margins (the reference plain ``margin_shift`` takes: the earliest recompute)."""
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("shadowed")
    book = ScenarioBook(root / "spool")
    for e in range(3):
        book.turn("canary", f"e{e}", 0, PROMPT + [e], TOKENS, [m + 0.25 for m in REFERENCE], arm="canary",
                  weight_format="Q4_K_M", at=TWO_HOURS_AGO - 60)
        book.turn("live", f"e{e}", 0, PROMPT + [e], TOKENS, [m + 0.25 for m in REFERENCE], cache=HIT, arm="",
                  weight_format="Q4_K_M", at=TWO_HOURS_AGO)
        book.turn("live", f"e{e}", 0, PROMPT + [e], TOKENS, REFERENCE, arm=sc.ARM_SHADOW, weight_format="Q4_K_M",
                  at=TWO_HOURS_AGO + 1)
    client = connect(f"chdb://{root / 'db'}")
    init_schema(client)
    book.ingest(client)
    client.close()
    return {"url": f"chdb://{root / 'db'}", "spool": str(root / "spool")}


def active_alerts(alertmanager, rule=RULE) -> list[dict]:
    query = urllib.parse.urlencode({"filter": f'alertname="{rule["name"]}"'})
    return get_json(f"{alertmanager['url']}/api/v2/alerts?{query}")


def notification(oncall, status: str) -> dict:
    """The Alertmanager's next webhook notification, which must say ``status``."""
    deadline = time.monotonic() + NOTIFY_S
    while not oncall.posts:
        if time.monotonic() > deadline:
            pytest.fail(f"the Alertmanager sent no {status} notification within {NOTIFY_S} s")
        time.sleep(0.1)
    path, body = oncall.posts.pop(0)
    assert path == "/kvtrace-alerts" and body["status"] == status, body
    return body


def test_the_shadow_metric_compares_live_hits_with_their_twins_and_counts_their_episodes(shadowed):
    from kvtrace.alerts.evaluation import evaluate
    from kvtrace.alerts.rules import parse_config
    from kvtrace.db import connect

    client = connect(shadowed["url"])
    try:
        canary, live = evaluate(client, parse_config({"rules": [RULE, SHADOW_RULE]}), TWO_HOURS_AGO + 60).outcomes
    finally:
        client.close()
    assert canary.firing == [] and canary.rows == 1  # against the canary's recompute: no shift
    (alert,) = live.firing
    assert alert.value == pytest.approx(0.25) and alert.samples == 3  # 3 episodes, each one pair
    assert "over 3 shadow_episodes" in alert.annotations["description"]


@pytest.mark.parametrize("data, rule", [("recorded", RULE), ("shadowed", SHADOW_RULE)], ids=["canary", "shadow"])
def test_a_real_alertmanager_shows_the_alert_firing_then_resolved(data, rule, alertmanager, oncall, tmp_path, capsys,
                                                                   request):
    recorded = request.getfixturevalue(data)
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"rules": [rule], "delivery": {"alertmanager": {"url": alertmanager["url"]}}}))

    def kvtrace_alert(*args: str) -> int:
        return main(["--db", recorded["url"], "--spool-dir", recorded["spool"], "-q", "alert", "--rules", str(rules),
                     "--state", str(tmp_path / "state.json"), *args])

    # The window ending just after the shifted hits: firing.
    assert kvtrace_alert("--at", str(TWO_HOURS_AGO + 60)) == 1
    assert f"FIRING   {rule['name']}" in capsys.readouterr().out
    (alert,) = active_alerts(alertmanager, rule)
    assert alert["status"]["state"] == "active"
    assert alert["labels"]["source"] == "kvtrace" and alert["labels"]["weight_format"] == "Q4_K_M"
    assert [r["name"] for r in alert["receivers"]] == [alertmanager["receiver"]]  # the example's route
    fired = notification(oncall, "firing")
    assert [a["labels"] for a in fired["alerts"]] == [alert["labels"]]

    # Still firing a minute later: the Alertmanager keeps the one alert alive.
    assert kvtrace_alert("--at", str(TWO_HOURS_AGO + 120)) == 1
    (again,) = active_alerts(alertmanager, rule)
    assert again["fingerprint"] == alert["fingerprint"] and again["startsAt"] == alert["startsAt"]

    # Now: no shifted hits in the last 30 minutes. Resolved, in the Alertmanager's own words.
    assert kvtrace_alert() == 0
    assert f"RESOLVED {rule['name']}" in capsys.readouterr().out
    assert active_alerts(alertmanager, rule) == []
    resolved = notification(oncall, "resolved")
    assert [(a["labels"], a["status"]) for a in resolved["alerts"]] == [(alert["labels"], "resolved")]
    assert oncall.posts == []
