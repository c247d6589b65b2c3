"""OTLP/JSON lines for the fault tests: one span per line, unique ids, and ways to spoil a line."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

from kvtrace import semconv as sc

BASE_NS = time.time_ns() - 3_600_000_000_000


def _array(*values: dict) -> dict:
    return {"arrayValue": {"values": list(values)}}


def request(i: int, run_id: str = "fault-run", name: str = sc.SPAN_REQUEST) -> dict:
    """An export request holding one kvtrace request span (turn ``i``) with ids unique to ``i``."""
    start = BASE_NS + i * 1_000_000
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "fault-tests"}}]},
        "scopeSpans": [{"scope": {"name": "kvtrace", "version": "0"}, "spans": [{
            "traceId": "%032x" % (0xA0000000 + i), "spanId": "%016x" % (0xB0000000 + i),
            "name": name, "kind": 1, "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 5000),
            "attributes": [
                {"key": sc.RUN_ID, "value": {"stringValue": run_id}},
                {"key": sc.EPISODE_ID, "value": {"stringValue": "e0"}},
                {"key": sc.TURN, "value": {"intValue": str(i)}},
                {"key": sc.OUTPUT_TOKEN_IDS, "value": _array({"intValue": "7"}, {"intValue": "8"})},
                {"key": sc.OUTPUT_MARGINS, "value": _array({"doubleValue": 0.5}, {"doubleValue": 1.5})},
            ],
            "events": [{"timeUnixNano": str(start + 10), "name": sc.EVENT_CACHE_LOOKUP, "attributes": []}],
            "status": {"code": 1},
        }]}],
    }]}


def span_of(req: dict) -> dict:
    return req["resourceSpans"][0]["scopeSpans"][0]["spans"][0]


def spoiled(i: int, spoil) -> dict:
    """Request ``i`` with ``spoil(request)`` applied to a deep copy (spoil mutates it)."""
    req = copy.deepcopy(request(i))
    spoil(req)
    return req


def line(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def write_lines(path: Path, values) -> Path:
    path.write_text("".join(line(v) + "\n" for v in values))
    return path


def dead_writer_name(spool: Path, seq: int = 0) -> Path:
    """A spool file name whose writer process has ended (so its file counts as finished)."""
    import subprocess
    import sys

    from kvtrace.recording.exporters.spool import spool_host

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return Path(spool) / f"kvtrace-{spool_host()}-{proc.pid}-{os.getpid()}-{seq:06d}.jsonl"
