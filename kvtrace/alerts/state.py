"""What was firing at the last evaluation, and which receivers still have to hear about it.

Kept in memory across ``--watch`` iterations and in a small JSON file between
separate runs (default: ``<data dir>/alerts/<hash of the rules file path>.json``),
so that a one-shot ``kvtrace alert`` from cron also sends "resolved" when an
alert it reported earlier has cleared, and retries deliveries that failed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from kvtrace.config import data_home

FIRING = "firing"
RESOLVED = "resolved"


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
        state = cls(path)
        try:
            raw = json.loads(path.read_text())
            state.alerts = {fp: TrackedAlert(**entry) for fp, entry in raw.get("alerts", {}).items()}
        except FileNotFoundError:
            pass
        except (ValueError, TypeError) as exc:
            # A damaged state file only costs "resolved" notices for alerts it knew; say so and start over.
            import sys

            print(f"kvtrace: warning: alert state {path} unreadable ({exc}); starting with no alerts",
                  file=sys.stderr)
        return state

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"alerts": {fp: asdict(a) for fp, a in self.alerts.items()}}, indent=1))
        os.replace(tmp, self.path)  # never a half-written state file


def default_state_path(rules_path: Path) -> Path:
    digest = hashlib.sha256(str(Path(rules_path).resolve()).encode()).hexdigest()[:16]
    return data_home() / "alerts" / f"{digest}.json"
