"""What was firing at the last evaluation, and which receivers still have to hear about it.

Kept in memory across ``--watch`` iterations and in a small JSON file between
separate runs (default: ``<data dir>/alerts/<hash of the rules file path>.json``),
so that a one-shot ``kvtrace alert`` from cron also sends "resolved" when an
alert it reported earlier has cleared, and retries deliveries that failed.
The file is its user's alone (0600, written under a random name and renamed
into place: ``kvtrace/safe_files.py``), and it is read only as a regular file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvtrace.config import data_home
from kvtrace.errors import ConfigError
from kvtrace.safe_files import NotRegularFile, check_writable_dir, read_bounded, replace_private

FIRING = "firing"
RESOLVED = "resolved"
MAX_STATE_BYTES = 64 * 1024 * 1024
"""A state file holds the alerts of one rules file: far less than this."""


class AlertStateError(ConfigError):
    """The state file or its directory cannot be read or written (exit code 2: nothing was decided)."""


@dataclass
class TrackedAlert:
    rule: str
    labels: dict[str, str]
    annotations: dict[str, str]
    status: str
    starts_at: float
    ends_at: Optional[float] = None
    value: float = 0.0
    pending: list[str] = field(default_factory=list)
    """Receivers (``webhook``, ``alertmanager``) not yet told about the current status."""


class AlertState:
    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self.alerts: dict[str, TrackedAlert] = {}

    @classmethod
    def load(cls, path: Path) -> "AlertState":
        """The state saved at ``path`` (none yet: empty), checked to be writable before anything is evaluated.

        A file that is not a state file (damaged, or some other JSON such as ``[]``) is set aside
        as ``<name>.corrupt-<time>`` with a warning and the state starts empty: that only costs
        "resolved" notices for alerts it knew.  A path that cannot be read or written raises
        :class:`AlertStateError` — an evaluation whose outcome cannot be remembered would page again
        on every run.
        """
        state = cls(path)
        try:
            text = read_bounded(path, MAX_STATE_BYTES)
        except FileNotFoundError:
            text = None
        except NotRegularFile as exc:
            raise AlertStateError(f"alert state {exc}; give --state the path of a regular file") from None
        except OSError as exc:
            raise AlertStateError(f"cannot read alert state {path}: {exc.strerror or exc}") from None
        if text is not None:
            try:
                state.alerts = _parse(text)
            except ValueError as exc:
                state._set_aside(str(exc))
        state._check_writable()
        return state

    def _set_aside(self, reason: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as exc:
            where = f"could not be moved aside ({exc.strerror or exc}); it will be overwritten"
        print(f"kvtrace: warning: alert state {self.path} is not a state file ({reason}); {where}; "
              f"starting with no alerts", file=sys.stderr)

    def _check_writable(self) -> None:
        try:
            check_writable_dir(self.path.parent)
        except OSError as exc:
            raise AlertStateError(f"cannot write alert state next to {self.path}: {exc.strerror or exc}; "
                                  f"give --state a writable path") from None

    def save(self) -> None:
        if self.path is None:
            return
        text = json.dumps({"alerts": {fp: asdict(a) for fp, a in self.alerts.items()}}, indent=1)
        try:
            replace_private(self.path, text.encode())  # never a half-written state file
        except OSError as exc:
            raise AlertStateError(f"cannot save alert state {self.path}: {exc.strerror or exc}") from None


def _parse(text: bytes) -> dict[str, TrackedAlert]:
    """The alerts of a state file's bytes; ValueError says what is wrong with it."""
    try:
        raw = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("alerts"), dict):
        raise ValueError("expected an object with an `alerts` object")
    return {str(fp): _tracked(entry) for fp, entry in raw["alerts"].items()}


def _tracked(entry: Any) -> TrackedAlert:
    if not isinstance(entry, dict):
        raise ValueError("an alert entry is not an object")
    try:
        alert = TrackedAlert(**entry)
    except TypeError as exc:
        raise ValueError(f"an alert entry has the wrong fields ({exc})") from None
    checks = (
        isinstance(alert.rule, str),
        _string_map(alert.labels) and _string_map(alert.annotations),
        alert.status in (FIRING, RESOLVED),
        _finite(alert.starts_at) and (alert.ends_at is None or _finite(alert.ends_at)),
        isinstance(alert.value, (int, float)) and not isinstance(alert.value, bool),
        isinstance(alert.pending, list) and all(isinstance(p, str) for p in alert.pending),
    )
    if not all(checks):
        raise ValueError(f"alert entry for rule {alert.rule!r} has a value of the wrong type")
    return alert


def _string_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def default_state_path(rules_path: Path) -> Path:
    digest = hashlib.sha256(str(Path(rules_path).resolve()).encode()).hexdigest()[:16]
    return data_home() / "alerts" / f"{digest}.json"
