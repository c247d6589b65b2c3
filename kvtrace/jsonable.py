"""Query results and records as plain JSON values (the CLI's and the fork objects' JSON form)."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with datetimes as ISO text and non-finite floats (NaN: "no value") as ``None``."""
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value
