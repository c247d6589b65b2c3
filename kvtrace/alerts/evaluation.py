"""One evaluation: run every rule's saved query over its window and decide what fires.

A rule fires for each row of its query's answer whose value is above the
threshold and that rests on at least ``min_samples`` samples (matched
positions, compared episodes or generated positions): a handful of tokens
must not page anyone.  Rules that ask the same question (metric, window and
the filters the query cannot answer row by row) share one query: a file of
thousands of rules costs a few queries.  A rule whose query fails is reported
as not evaluated; its alerts keep their last known state.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvtrace import queries
from kvtrace.alerts.rules import AlertConfig, Rule


@dataclass(frozen=True)
class Alert:
    """One firing instance of a rule (one row of its query's answer)."""

    rule: str
    labels: dict[str, str]
    annotations: dict[str, str]
    value: float
    threshold: float
    samples: int

    @property
    def fingerprint(self) -> str:
        """Identity across evaluations: the rule and the labels, not the value."""
        return hashlib.sha256(json.dumps(self.labels, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class RuleOutcome:
    rule: Rule
    firing: list[Alert] = field(default_factory=list)
    rows: int = 0
    """Rows of the answer with enough samples to be judged."""
    error: str = ""


@dataclass
class Evaluation:
    at: float
    outcomes: list[RuleOutcome]

    @property
    def firing(self) -> list[Alert]:
        return [a for o in self.outcomes for a in o.firing]

    @property
    def failed(self) -> list[RuleOutcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def evaluated_rules(self) -> set[str]:
        return {o.rule.name for o in self.outcomes if not o.error}


def evaluate(client, config: AlertConfig, at: float) -> Evaluation:
    """Every rule over the window ending at ``at`` (epoch seconds): one query per distinct question."""
    questions: dict[tuple, list[int]] = {}
    for index, rule in enumerate(config.rules):
        params = rule.shared_params(at - rule.window_s, at)
        questions.setdefault((rule.measure.query, *sorted(params.items())), []).append(index)
    outcomes: list[RuleOutcome] = [RuleOutcome(rule) for rule in config.rules]
    for (query, *params), asking in questions.items():
        try:
            columns, rows = queries.run(client, query, dict(params))
        except Exception as exc:  # one broken question must not hide the others' answers
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for index in asking:
                outcomes[index].error = error
            continue
        answer = [dict(zip(columns, row)) for row in rows]
        for index in asking:
            outcomes[index] = judge(config.rules[index], answer)
    return Evaluation(at, outcomes)


def judge(rule: Rule, answer: list[dict[str, Any]]) -> RuleOutcome:
    """The rule's outcome on its question's answer (rows as column → value)."""
    outcome, metric = RuleOutcome(rule), rule.measure
    for values in answer:
        if metric.rollup_label and values.get(metric.rollup_label) == "(all)":
            continue
        if not rule.selects(values):
            continue
        value = float(values[metric.value_column])
        samples = int(values[metric.samples_column] or 0)
        if samples < rule.min_samples or not math.isfinite(value):
            continue
        outcome.rows += 1
        if value > rule.threshold:
            outcome.firing.append(_alert(rule, values, value, samples))
    return outcome


def _alert(rule: Rule, values: dict[str, Any], value: float, samples: int) -> Alert:
    metric = rule.measure
    labels = {"alertname": rule.name, "severity": rule.severity, "metric": rule.metric, "source": "kvtrace"}
    labels.update({c: str(values[c]) for c in metric.label_columns if str(values[c]) != ""})
    labels.update(rule.labels)
    where = ", ".join(f"{c}={values[c]}" for c in metric.label_columns if str(values[c]) != "")
    annotations = {
        "summary": f"{metric.description}: {value:.4g} > {rule.threshold:g}" + (f" ({where})" if where else ""),
        "description": (f"rule {rule.name}: {metric.query}.{metric.value_column} = {value:.6g} over "
                        f"{samples} {metric.samples_column} in the last {_duration(rule.window_s)}; "
                        f"threshold {rule.threshold:g}"),
        "value": f"{value:.6g}",
        "threshold": f"{rule.threshold:g}",
    }
    annotations.update(rule.annotations)
    return Alert(rule.name, labels, annotations, value, rule.threshold, samples)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
