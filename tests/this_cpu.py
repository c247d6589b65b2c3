"""What /proc/cpuinfo says of this machine's CPU: tests whose numbers depend on the kernels an engine picks
(a fork between cache arms, a weight layout) read it here."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _field(name: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.split(":", 1)[0].strip() == name), "")


def model_name() -> str:
    return _field("model name")


def flags() -> set[str]:
    return set(_field("flags").split())
