"""Delivery of alerts: a JSON webhook and a Prometheus Alertmanager (``/api/v2/alerts``).

A POST through kvtrace's HTTP client with a timeout, retried a few times.
Delivery never raises: a failure is returned as a message, and the caller
keeps the notification pending for the next evaluation.  Redirects are never
followed: a client that follows them repeats a POST answered 301/302/303 as a
GET, with the custom headers (``Authorization``) going to wherever the
redirect points, and a 2xx there would count as delivered; an answer other
than 2xx is a failed delivery.  Messages show a receiver's URL without its
path, query or user info, where such URLs carry their tokens.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from kvtrace import __version__
from kvtrace.alerts.rules import AlertmanagerConfig, DeliveryConfig, WebhookConfig
from kvtrace.alerts.state import FIRING, RESOLVED, TrackedAlert
from kvtrace.credentials import redacted_url
from kvtrace.http_client import HttpStatusError, request

WEBHOOK = "webhook"
ALERTMANAGER = "alertmanager"


def receivers(delivery: DeliveryConfig) -> list[str]:
    return [name for name, cfg in ((WEBHOOK, delivery.webhook), (ALERTMANAGER, delivery.alertmanager)) if cfg]


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def webhook_payload(alerts: list[TrackedAlert]) -> dict[str, Any]:
    """Shaped like Alertmanager's own webhook payload, so existing receivers can read it."""
    return {
        "version": "4",
        "receiver": "kvtrace",
        "status": FIRING if any(a.status == FIRING for a in alerts) else RESOLVED,
        "alerts": [
            {"status": a.status, "labels": a.labels, "annotations": a.annotations, "startsAt": iso(a.starts_at),
             "endsAt": iso(a.ends_at) if a.ends_at else "0001-01-01T00:00:00Z", "value": a.value}
            for a in alerts
        ],
        "source": f"kvtrace {__version__}",
    }


def alertmanager_payload(alerts: list[TrackedAlert], now: float, ends_after_s: Optional[float]) -> list[dict]:
    """Postable alerts: resolved ones carry an endsAt in the past; firing ones none (or now + ends_after)."""
    out = []
    for a in alerts:
        item: dict[str, Any] = {"labels": a.labels, "annotations": a.annotations, "startsAt": iso(a.starts_at)}
        if a.status != FIRING:
            item["endsAt"] = iso(a.ends_at or now)
        elif ends_after_s:
            item["endsAt"] = iso(now + ends_after_s)
        out.append(item)
    return out


def post_alerts(url: str, payload: Any, headers: dict[str, str], timeout_s: float) -> None:
    """POST ``payload`` as JSON; raises (``HttpStatusError``) unless the receiver itself answers 2xx.
    The answer's body is not read as JSON: receivers answer ``ok``, nothing or a document."""
    request("POST", url, payload, headers, timeout_s).raise_for_status()


class Deliverer:
    """Posts with retries; returns None on success, else what went wrong on the last attempt."""

    def __init__(self, delivery: DeliveryConfig, sleep: Callable[[float], None] = time.sleep,
                 post: Callable[..., None] = post_alerts):
        self.delivery = delivery
        self._sleep = sleep
        self._post = post

    def send_webhook(self, alerts: list[TrackedAlert]) -> Optional[str]:
        cfg: WebhookConfig = self.delivery.webhook
        return self._with_retries(cfg.url, webhook_payload(alerts), cfg.headers, cfg.timeout_s)

    def send_alertmanager(self, alerts: list[TrackedAlert], now: float) -> Optional[str]:
        cfg: AlertmanagerConfig = self.delivery.alertmanager
        return self._with_retries(f"{cfg.url}/api/v2/alerts", alertmanager_payload(alerts, now, cfg.ends_after_s),
                                  cfg.headers, cfg.timeout_s)

    def _with_retries(self, url: str, payload: Any, headers: dict[str, str], timeout_s: float) -> Optional[str]:
        error = None
        shown = redacted_url(url)
        for attempt in range(self.delivery.attempts):
            if attempt:
                self._sleep(self.delivery.retry_delay_s * attempt)
            try:
                self._post(url, payload, headers, timeout_s)
                return None
            except HttpStatusError as exc:
                error = f"{shown}: HTTP {exc.status} {exc.reason}"
                if 300 <= exc.status < 400:
                    error += " (a redirect, not followed: configure the URL it points to)"
            except Exception as exc:  # refused, timed out, DNS...: all the same to the loop
                error = f"{shown}: {str(getattr(exc, 'reason', None) or exc).replace(url, shown)}"
        return f"{error} (after {self.delivery.attempts} attempt(s))"
