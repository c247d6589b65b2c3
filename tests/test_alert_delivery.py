"""Webhook and Alertmanager delivery against real HTTP servers on 127.0.0.1.  A receiver that
answers a redirect has not taken the alert: a client that follows it would repeat the POST as a GET,
with the ``Authorization`` header, at wherever the redirect points, and count that as delivered.  So a 3xx
is a failed delivery (retried, kept pending), nothing is sent to the redirect's target, and no
message shows the receiver's token (in its path or query) or a header's value; those can come from
the environment or a file instead of the rules file."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from receivers import Loopback

from kvtrace.alerts.delivery import Deliverer
from kvtrace.alerts.rules import AlertRulesError, parse_config
from kvtrace.alerts.state import FIRING, TrackedAlert

RULE = {"name": "shift", "metric": "margin_shift_p95_abs", "threshold": 0.1}
TOKEN = "T0K3N-in-the-path"
SECRET_HEADER = "Bearer s3cret-header-value"


def Server(status: int = 200, location: str = "") -> Loopback:
    """Answers every request with ``status`` (and a Location to ``location``), recording what it got."""
    return Loopback(lambda method, path, body: (status, {"Location": location} if location else {}, b""))


@pytest.fixture
def servers():
    started: list[Loopback] = []

    def start(*args) -> Loopback:
        started.append(Server(*args))
        return started[-1]

    yield start
    for server in started:
        server.close()


def firing() -> list[TrackedAlert]:
    return [TrackedAlert("shift", {"alertname": "shift"}, {"summary": "s"}, FIRING, starts_at=1e9, value=0.3)]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_failed_delivery_and_is_never_followed(servers, status, monkeypatch):
    target = servers()
    redirecting = servers(status, f"{target.url}/elsewhere")
    monkeypatch.setenv("HOOK_AUTH", SECRET_HEADER)
    config = parse_config({"rules": [RULE], "delivery": {
        "webhook": {"url": f"{redirecting.url}/hooks/{TOKEN}?key={TOKEN}",
                    "headers": {"Authorization": {"env": "HOOK_AUTH"}}},
        "alertmanager": {"url": redirecting.url}, "attempts": 2, "retry_delay": 0}})
    deliverer = Deliverer(config.delivery)
    webhook_error = deliverer.send_webhook(firing())
    alertmanager_error = deliverer.send_alertmanager(firing(), now=1e9)
    assert webhook_error == (f"{redirecting.url}/…: HTTP {status} {HTTPStatus(status).phrase} (a redirect, not "
                             "followed: configure the URL it points to) (after 2 attempt(s))")
    assert alertmanager_error.startswith(f"{redirecting.url}/…: HTTP {status} ")
    assert [method for method, _, _ in redirecting.requests] == ["POST"] * 4  # retried, each a POST
    assert redirecting.requests[0][2]["Authorization"] == SECRET_HEADER  # the header comes from the environment
    assert target.requests == []  # nothing, and no Authorization, went where the redirect pointed
    assert TOKEN not in webhook_error + alertmanager_error and "s3cret" not in webhook_error + alertmanager_error


def test_an_answer_of_2xx_is_a_delivery(servers):
    receiver = servers(202)
    config = parse_config({"rules": [RULE], "delivery": {"webhook": {"url": f"{receiver.url}/hook"}}})
    assert Deliverer(config.delivery).send_webhook(firing()) is None
    assert [(method, path) for method, path, _ in receiver.requests] == [("POST", "/hook")]


def test_an_unreachable_receiver_is_named_without_its_token():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = parse_config({"rules": [RULE], "delivery": {
        "webhook": {"url": f"http://hook:{TOKEN}@127.0.0.1:{port}/services/{TOKEN}"}, "attempts": 1}})
    error = Deliverer(config.delivery).send_webhook(firing())
    assert error.startswith(f"http://127.0.0.1:{port}/…: ") and TOKEN not in error


def test_the_webhook_url_and_header_values_can_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    (tmp_path / "url").write_text("https://hooks.example/services/abc\n")
    monkeypatch.setenv("HOOK_AUTH", SECRET_HEADER)
    config = parse_config({"rules": [RULE], "delivery": {"webhook": {
        "url": {"file": str(tmp_path / "url")}, "headers": {"Authorization": {"env": "HOOK_AUTH"}, "X-Team": "ml"}}}})
    assert config.delivery.webhook.url == "https://hooks.example/services/abc"
    assert config.delivery.webhook.headers == {"Authorization": SECRET_HEADER, "X-Team": "ml"}


@pytest.mark.parametrize("webhook, message", [
    ({"url": {"env": "NO_SUCH_VARIABLE"}}, "environment variable NO_SUCH_VARIABLE is not set"),
    ({"url": {"file": "/no/such/file"}}, "/no/such/file is not a readable regular file"),
    ({"url": {"env": "X", "file": "y"}}, "expected a string, `{env: NAME}` or `{file: PATH}`"),
    ({"url": "http://h/x", "headers": {"Authorization": {"env": "NO_SUCH_VARIABLE"}}}, "header Authorization"),
])
def test_a_credential_that_cannot_be_read_is_refused_naming_where_not_what(webhook, message, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VARIABLE", raising=False)
    with pytest.raises(AlertRulesError) as refused:
        parse_config({"rules": [RULE], "delivery": {"webhook": webhook}})
    assert message in str(refused.value)
