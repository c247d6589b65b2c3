"""The alert rules file (YAML): what to measure, over which window, above which threshold.

Example (see ``examples/alert-rules.yaml`` for a commented one)::

    rules:
      - name: cache-path-margin-shift
        metric: margin_shift_p95_abs
        threshold: 0.05          # fires when the value is above it
        window: 30m
        min_samples: 50          # matched positions / compared episodes / generated positions
        filters: {engine: llama_cpp, weight_format: Q4_K_M}
    delivery:
      webhook:
        url: {env: KVTRACE_WEBHOOK_URL}          # or a string, or {file: /run/secrets/webhook-url}
        headers: {Authorization: {env: KVTRACE_WEBHOOK_AUTH}}
      alertmanager: {url: "http://alertmanager:9093"}

A metric names the saved query that measures it and the column whose value
is compared; each row of the query's answer (per weight format, per
configuration...) is its own alert instance, labelled with the row's grouping
columns.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from kvtrace import semconv as sc
from kvtrace.credentials import read_secret_env, read_secret_file
from kvtrace.errors import ConfigError


class AlertRulesError(ConfigError):
    """The rules file cannot be read or a rule is malformed (exit code 2)."""


@dataclass(frozen=True)
class Metric:
    """What a rule measures: a saved query's column, per row."""

    query: str
    value_column: str
    samples_column: str
    label_columns: tuple[str, ...]
    description: str
    rollup_label: Optional[str] = None
    """A label column whose value ``(all)`` marks a roll-up row (skipped: its parts are alerted on)."""
    row_filters: tuple[str, ...] = ()
    """Filters the query answers row by row (grouping columns that each request falls in by itself): a
    rule's filter on one of them picks rows of the shared answer rather than changing the query."""
    params: tuple[tuple[str, str], ...] = ()
    """Query parameters the metric fixes (the shadow metrics: references of arm ``shadow`` only)."""


NO_INTERVAL = (("interval", "0"),)
"""margin_shift without its bootstrap interval: a rule reads the value and the samples, and the interval
is most of the query's time."""

METRICS: dict[str, Metric] = {
    "margin_shift_mean_abs": Metric(
        "margin_shift", "mean_abs_shift", "positions", ("weight_format",),
        "mean |Δ margin| between cache-hit and recompute paths at matched positions", rollup_label="weight_format",
        row_filters=("weight_format",), params=NO_INTERVAL),
    "margin_shift_p95_abs": Metric(
        "margin_shift", "p95_abs_shift", "positions", ("weight_format",),
        "p95 |Δ margin| between cache-hit and recompute paths at matched positions", rollup_label="weight_format",
        row_filters=("weight_format",), params=NO_INTERVAL),
    # Live traffic: cache hits against the cold twins `kvtrace proxy --shadow` sent of them; the samples
    # are the episodes the pairs come from (the independent ones), not their positions.
    "shadow_margin_shift_mean_abs": Metric(
        "margin_shift", "mean_abs_shift", "shadow_episodes", ("weight_format",),
        "mean |Δ margin| between live cache hits and their shadow twins at matched positions",
        rollup_label="weight_format", row_filters=("weight_format",), params=NO_INTERVAL + (("reference_arm", sc.ARM_SHADOW),)),
    "shadow_margin_shift_p95_abs": Metric(
        "margin_shift", "p95_abs_shift", "shadow_episodes", ("weight_format",),
        "p95 |Δ margin| between live cache hits and their shadow twins at matched positions",
        rollup_label="weight_format", row_filters=("weight_format",), params=NO_INTERVAL + (("reference_arm", sc.ARM_SHADOW),)),
    # No row filters: a configuration is a whole run's, so a filter changes which requests make up a run.
    "divergence_rate": Metric(
        "divergence_rates", "fork_rate", "episodes_compared", ("engine", "weight_format", "arm", "compared_with"),
        "share of episodes that forked between paired runs"),
    "near_tie_share": Metric(
        "near_tie_share", "near_tie_share", "positions", ("engine", "model", "weight_format"),
        "share of near-tie decisions on cache-hit paths", row_filters=("engine", "model", "weight_format")),
    "integrity_violations": Metric(
        "integrity_violation_counts", "violations", "requests", ("engine", "model", "weight_format"),
        "cache integrity violations: requests that continued from a state not their prompt's own prefix",
        row_filters=("engine", "model", "weight_format")),
}

FILTER_KEYS = ("engine", "model", "weight_format")
SEVERITIES = ("info", "warning", "critical")
DEFAULT_WINDOW_S = 3600.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: Any, what: str) -> float:
    """``90``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1d"`` → seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
        return float(value)
    m = _DURATION.match(str(value)) if isinstance(value, str) else None
    if not m or not 0 < float(m.group(1)) < math.inf:
        raise AlertRulesError(f"{what}: {value!r} is not a duration; write e.g. 90s, 30m, 2h or 1d")
    return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]


@dataclass(frozen=True)
class Rule:
    name: str
    metric: str
    threshold: float
    window_s: float = DEFAULT_WINDOW_S
    min_samples: int = 1
    filters: dict[str, str] = field(default_factory=dict)
    run_prefix: str = ""
    baseline_arm: str = ""
    """divergence_rate only: compare every arm with this one ('' = repeat runs of one configuration)."""
    near_tie: float = 0.05
    """near_tie_share only: the margin (raw logits) below which a decision is a near tie."""
    severity: str = "warning"
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def measure(self) -> Metric:
        return METRICS[self.metric]

    def query_params(self, since: float, until: float) -> dict[str, Any]:
        """The saved query's parameters for the window [since, until) (epoch seconds), every filter in them."""
        params: dict[str, Any] = {"run_prefix": self.run_prefix, "since": f"{since:.3f}", "until": f"{until:.3f}"}
        params.update({key: self.filters.get(key, "") for key in FILTER_KEYS})
        params.update(self.measure.params)
        if self.metric == "divergence_rate":
            params["baseline_arm"] = self.baseline_arm
        if self.metric == "near_tie_share":
            params["near_tie"] = self.near_tie
        return params

    def shared_params(self, since: float, until: float) -> dict[str, Any]:
        """:meth:`query_params` without the filters the answer gives row by row: rules that differ only
        in those (and in thresholds, names, labels) ask the same question once."""
        params = self.query_params(since, until)
        params.update({key: "" for key in self.measure.row_filters})
        return params

    def selects(self, row: dict[str, Any]) -> bool:
        """Whether a row of the shared answer is one this rule's row filters keep."""
        return all(str(row[key]) == self.filters[key] for key in self.measure.row_filters if key in self.filters)


@dataclass(frozen=True)
class WebhookConfig:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 5.0


@dataclass(frozen=True)
class AlertmanagerConfig:
    url: str
    """Base URL of the Alertmanager (``http://alertmanager:9093``); alerts go to ``/api/v2/alerts``."""
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 5.0
    ends_after_s: Optional[float] = None
    """endsAt of a firing alert, relative to the evaluation; None: Alertmanager's resolve_timeout applies."""


@dataclass(frozen=True)
class DeliveryConfig:
    webhook: Optional[WebhookConfig] = None
    alertmanager: Optional[AlertmanagerConfig] = None
    attempts: int = 3
    retry_delay_s: float = 1.0


@dataclass(frozen=True)
class AlertConfig:
    rules: tuple[Rule, ...]
    delivery: DeliveryConfig


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML was built with it: several times faster on a file of thousands of rules."""


def load_rules(path: Path) -> AlertConfig:
    path = Path(path)
    if path.exists() and not path.is_file():  # a directory, or a FIFO that would block the read
        raise AlertRulesError(f"rules file {path} is not a regular file")
    try:
        document = yaml.load(path.read_bytes().decode("utf-8"), Loader=_SAFE_LOADER)
    except FileNotFoundError:
        raise AlertRulesError(f"rules file {path} does not exist; see examples/alert-rules.yaml") from None
    except UnicodeDecodeError as exc:
        raise AlertRulesError(f"rules file {path} is not UTF-8 text "
                              f"(byte {exc.start} is {exc.object[exc.start]:#04x})") from None
    except OSError as exc:
        raise AlertRulesError(f"cannot read rules file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise AlertRulesError(f"rules file {path} is not valid YAML: {_one_line(exc)}") from None
    return parse_config(document, str(path))


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def parse_config(document: Any, source: str = "rules") -> AlertConfig:
    if not isinstance(document, dict) or not isinstance(document.get("rules"), list) or not document["rules"]:
        raise AlertRulesError(f"{source}: expected a mapping with a non-empty `rules:` list")
    _no_unknown(document, {"rules", "delivery", "defaults"}, source)
    defaults = _mapping(document.get("defaults"), f"{source}: defaults")
    rules = []
    for index, raw in enumerate(document["rules"]):
        raw = _mapping(raw, f"{source}: rule #{index + 1}")
        rules.append(_rule({**defaults, **raw}, f"{source}: rule #{index + 1}"))
    duplicates = sorted(name for name, count in Counter(r.name for r in rules).items() if count > 1)
    if duplicates:
        raise AlertRulesError(f"{source}: rule names must be unique; repeated: {', '.join(duplicates)}")
    return AlertConfig(tuple(rules), _delivery(document.get("delivery"), f"{source}: delivery"))


def _rule(raw: dict[str, Any], where: str) -> Rule:
    _no_unknown(raw, {"name", "metric", "threshold", "window", "min_samples", "filters", "run_prefix",
                      "baseline_arm", "near_tie", "severity", "labels", "annotations"}, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise AlertRulesError(f"{where}: needs a `name`")
    where = f"{where} ({name})"
    metric = raw.get("metric")
    if metric not in METRICS:
        raise AlertRulesError(f"{where}: metric {metric!r} is not one of {', '.join(METRICS)}")
    threshold = _number(raw.get("threshold"), f"{where}: threshold")
    filters = {k: str(v) for k, v in _mapping(raw.get("filters"), f"{where}: filters").items()}
    unknown = sorted(set(filters) - set(FILTER_KEYS))
    if unknown:
        raise AlertRulesError(f"{where}: unknown filter {', '.join(unknown)}; filters are {', '.join(FILTER_KEYS)}")
    severity = str(raw.get("severity", "warning"))
    if severity not in SEVERITIES:
        raise AlertRulesError(f"{where}: severity {severity!r} is not one of {', '.join(SEVERITIES)}")
    min_samples = raw.get("min_samples", 1)
    if not isinstance(min_samples, int) or isinstance(min_samples, bool) or min_samples < 1:
        raise AlertRulesError(f"{where}: min_samples must be a whole number >= 1")
    return Rule(
        name=name.strip(), metric=metric, threshold=threshold,
        window_s=parse_duration(raw.get("window", DEFAULT_WINDOW_S), f"{where}: window"),
        min_samples=min_samples, filters=filters, run_prefix=str(raw.get("run_prefix", "")),
        baseline_arm=str(raw.get("baseline_arm", "")),
        near_tie=_non_negative(raw.get("near_tie", 0.05), f"{where}: near_tie"), severity=severity,
        labels=_strings(raw.get("labels"), f"{where}: labels"),
        annotations=_strings(raw.get("annotations"), f"{where}: annotations"),
    )


def _delivery(raw: Any, where: str) -> DeliveryConfig:
    raw = _mapping(raw, where)
    _no_unknown(raw, {"webhook", "alertmanager", "attempts", "retry_delay"}, where)
    webhook = alertmanager = None
    if raw.get("webhook") is not None:
        w = _mapping(raw["webhook"], f"{where}: webhook")
        _no_unknown(w, {"url", "headers", "timeout"}, f"{where}: webhook")
        webhook = WebhookConfig(_url(w.get("url"), f"{where}: webhook"),
                                _headers(w.get("headers"), f"{where}: webhook"),
                                parse_duration(w.get("timeout", 5), f"{where}: webhook timeout"))
    if raw.get("alertmanager") is not None:
        a = _mapping(raw["alertmanager"], f"{where}: alertmanager")
        _no_unknown(a, {"url", "headers", "timeout", "ends_after"}, f"{where}: alertmanager")
        ends_after = a.get("ends_after")
        alertmanager = AlertmanagerConfig(
            _url(a.get("url"), f"{where}: alertmanager"), _headers(a.get("headers"), f"{where}: alertmanager"),
            parse_duration(a.get("timeout", 5), f"{where}: alertmanager timeout"),
            parse_duration(ends_after, f"{where}: alertmanager ends_after") if ends_after is not None else None)
    attempts = raw.get("attempts", 3)
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise AlertRulesError(f"{where}: attempts must be a whole number >= 1")
    delay = raw.get("retry_delay", 1)
    return DeliveryConfig(webhook, alertmanager, attempts,
                          0.0 if delay in (0, "0") else parse_duration(delay, f"{where}: retry_delay"))


def _url(value: Any, where: str) -> str:
    value = _credential(value, f"{where} url")
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise AlertRulesError(f"{where}: needs `url: http(s)://...` (or `url: {{env: NAME}}` / `{{file: PATH}}`)")
    return value.rstrip("/")


def _headers(value: Any, where: str) -> dict[str, str]:
    return {str(name): str(_credential(v, f"{where} header {name}")) for name, v in _mapping(value, where).items()}


def _credential(value: Any, where: str) -> Any:
    """``{env: NAME}`` or ``{file: PATH}`` read from there (a token kept out of the rules file), anything
    else as it is."""
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in ("env", "file"):
        raise AlertRulesError(f"{where}: expected a string, `{{env: NAME}}` or `{{file: PATH}}`")
    (source, name), = value.items()
    try:
        if source == "env":
            return read_secret_env(os.environ, str(name), where)
        return read_secret_file(os.path.expanduser(str(name)), where)
    except ConfigError as exc:
        raise AlertRulesError(str(exc)) from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AlertRulesError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _strings(value: Any, where: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in _mapping(value, where).items()}


def _number(value: Any, where: str) -> float:
    # A NaN threshold would make every comparison false: a rule that can never fire, reported as all clear.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AlertRulesError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _non_negative(value: Any, where: str) -> float:
    number = _number(value, where)
    if number < 0:
        raise AlertRulesError(f"{where}: must not be negative, got {value!r}")
    return number


def _no_unknown(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(map(str, set(raw) - known))
    if unknown:
        raise AlertRulesError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
