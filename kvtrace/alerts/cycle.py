"""One alerting cycle: evaluate, update what is firing, tell the receivers.

The alerting modules: ``alert_rules`` reads the YAML rules file,
``alert_evaluation`` runs each rule's saved query over its time window and
decides what fires, ``alert_state`` remembers what was firing (so a clear
evaluation can send "resolved"), ``alert_delivery`` posts to a webhook and to a
Prometheus Alertmanager, and this module ties one evaluation together.
``kvtrace alert`` (``commands/alert.py``) is the command in front of it.

Transitions: an alert that fires and was not firing becomes ``firing``
(startsAt = this evaluation); one that was firing and no longer fires becomes
``resolved`` (endsAt = this evaluation) — but only when its rule was evaluated:
a rule whose query failed leaves its alerts as they were.  The webhook hears
about transitions; the Alertmanager gets every firing alert on every cycle
(that is how it keeps them alive) plus the newly resolved ones.  A receiver
that could not be reached keeps its notifications pending for the next cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace.alerts.delivery import ALERTMANAGER, WEBHOOK, Deliverer, receivers
from kvtrace.alerts.evaluation import Evaluation
from kvtrace.alerts.rules import AlertConfig
from kvtrace.alerts.state import FIRING, RESOLVED, AlertState, TrackedAlert


@dataclass
class CycleReport:
    evaluation: Evaluation
    started: list[TrackedAlert] = field(default_factory=list)
    resolved: list[TrackedAlert] = field(default_factory=list)
    delivery_errors: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 all clear, 1 firing, 2 some rule could not be evaluated."""
        if self.evaluation.failed:
            return 2
        return 1 if self.evaluation.firing else 0


def apply(state: AlertState, evaluation: Evaluation, config: AlertConfig) -> CycleReport:
    """Update ``state`` with ``evaluation``; returns the transitions."""
    report = CycleReport(evaluation)
    targets = receivers(config.delivery)
    now = evaluation.at
    firing_now = {a.fingerprint: a for a in evaluation.firing}
    for fp, alert in firing_now.items():
        tracked = state.alerts.get(fp)
        if tracked is None or tracked.status != FIRING:
            tracked = TrackedAlert(alert.rule, alert.labels, alert.annotations, FIRING, starts_at=now,
                                   value=alert.value, pending=list(targets))
            state.alerts[fp] = tracked
            report.started.append(tracked)
        else:
            tracked.annotations, tracked.value = alert.annotations, alert.value
    evaluated, failed = evaluation.evaluated_rules, _failed(evaluation)
    configured = {r.name for r in config.rules}
    for fp, tracked in state.alerts.items():
        if tracked.status == FIRING and fp not in firing_now and tracked.rule not in failed:
            if tracked.rule in evaluated or tracked.rule not in configured:
                tracked.status, tracked.ends_at, tracked.pending = RESOLVED, now, list(targets)
                report.resolved.append(tracked)
    return report


def deliver(state: AlertState, report: CycleReport, config: AlertConfig, deliverer: Deliverer) -> None:
    """Send what is pending; failures are reported and stay pending, never raised."""
    now = report.evaluation.at
    if config.delivery.webhook:
        due = [a for a in state.alerts.values() if WEBHOOK in a.pending]
        if due:
            error = deliverer.send_webhook(due)
            _settle(due, WEBHOOK, error, report)
    if config.delivery.alertmanager:
        due = [a for a in state.alerts.values() if a.status == FIRING or ALERTMANAGER in a.pending]
        if due:
            error = deliverer.send_alertmanager(due, now)
            _settle(due, ALERTMANAGER, error, report)
    # Resolved alerts everyone has heard about are done; so are notices for receivers no longer configured.
    configured = set(receivers(config.delivery))
    for fp in list(state.alerts):
        tracked = state.alerts[fp]
        tracked.pending = [p for p in tracked.pending if p in configured]
        if tracked.status == RESOLVED and not tracked.pending:
            del state.alerts[fp]


def _settle(alerts: list[TrackedAlert], receiver: str, error, report: CycleReport) -> None:
    if error:
        report.delivery_errors.append(f"{receiver} delivery failed: {error}; will retry at the next evaluation")
        for a in alerts:
            if receiver not in a.pending:
                a.pending.append(receiver)
        return
    for a in alerts:
        if receiver in a.pending:
            a.pending.remove(receiver)


def _failed(evaluation: Evaluation) -> set[str]:
    return {o.rule.name for o in evaluation.failed}
