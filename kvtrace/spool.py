"""The spool: append-only OTLP/JSON files, one writer process per file.

Layout of a spool directory::

    kvtrace-<host>-<pid>-<start_ns>-<seq>.jsonl   one ExportTraceServiceRequest per line
    stats/<host>-<pid>-<start_ns>.json            span counters of that process
    quarantine/                                   lines ingest could not parse

Each process writes its own files (so many processes never interleave), every
line is written with one ``write`` of a complete ``...\\n`` record, and a file
is rotated once it passes ``rotate_bytes``.  A reader may therefore take any
file up to its last newline at any time.  A process that forks starts new
files in the child.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.otlp_json import encode_request

SPOOL_SUFFIX = ".jsonl"
_NAME = re.compile(r"^kvtrace-(?P<host>.+)-(?P<pid>\d+)-(?P<start>\d+)-(?P<seq>\d+)\.jsonl$")


def writer_of(path: Path) -> Optional[tuple[str, int]]:
    """(host, pid) of the kvtrace process that writes ``path``, if it is a spool file."""
    m = _NAME.match(path.name)
    return (m["host"], int(m["pid"])) if m else None


def spool_host() -> str:
    """This machine's name as it appears in spool file names."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


class SpoolWriter:
    """Appends encoded lines to this process's current spool file."""

    def __init__(self, directory: Path, rotate_bytes: int):
        self.directory = Path(directory)
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self._pid = -1
        self._seq = 0
        self._size = 0
        self._start_ns = 0
        self.path: Optional[Path] = None

    def process_tag(self) -> str:
        return f"{spool_host()}-{os.getpid()}-{self._start_ns}"

    def _open(self) -> None:
        if self._pid != os.getpid():
            # New process (first use or after fork): new name, sequence from zero.
            self._pid = os.getpid()
            self._start_ns = time.time_ns()
            self._seq = 0
            self._fd = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"kvtrace-{self.process_tag()}-{self._seq:06d}{SPOOL_SUFFIX}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode()
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                self._open()
            elif self._size >= self.rotate_bytes:
                os.close(self._fd)
                self._seq += 1
                self._open()
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            self._size += len(data)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None


class SpoolExporter(SpanExporter):
    """SpanExporter that writes each batch as one OTLP/JSON line to the spool."""

    def __init__(self, directory: Path, rotate_bytes: int = 64 * 1024 * 1024):
        self.writer = SpoolWriter(directory, rotate_bytes)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if spans:
            self.writer.write_line(encode_request(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.writer.close()


def write_stats(directory: Path, process_tag: str, counters: dict) -> None:
    """Publish this process's span counters for ``kvtrace db status`` (atomic replace)."""
    stats_dir = Path(directory) / "stats"
    stats_dir.mkdir(parents=True, exist_ok=True)
    target = stats_dir / f"{process_tag}.json"
    tmp = stats_dir / f".{process_tag}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "updated_unix": time.time(), **counters}))
    os.replace(tmp, target)


def read_stats(directory: Path) -> list[dict]:
    out = []
    for path in sorted((Path(directory) / "stats").glob("*.json")):
        try:
            out.append({"process": path.stem, **json.loads(path.read_text())})
        except (OSError, ValueError):
            continue
    return out
