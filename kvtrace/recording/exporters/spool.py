"""The spool: append-only OTLP/JSON files, one writer process per file.

Layout of a spool directory::

    kvtrace-<host>-<pid>-<start_ns>-<seq>.jsonl   one ExportTraceServiceRequest per line
    stats/<host>-<pid>-<start_ns>.stats           span counters of that process (kvtrace/stats.py)
    quarantine/                                   lines ingest could not parse

Each process writes its own files (so many processes never interleave), every
line is appended as a complete ``...\\n`` record, and a file is rotated once
it passes ``rotate_bytes``.  A write that fails part-way (a full disk) is cut
back to the end of the previous line, so the file never holds a torn record
followed by good ones; when even that fails the file is left and the next
line starts a new one.  A reader may therefore take any file up to its last
newline at any time.  A process that forks starts new files in the child.

Lines are OTLP/JSON with kvtrace's per-token arrays packed (``kvtrace/recording/packed_arrays.py``):
one base64 ``bytesValue`` per array instead of one value object per token.  A string UTF-8 cannot
carry (a lone surrogate from a client) is written repaired, never failing its batch
(``otlp_json.utf8_line``).

Directories are made 0700 and files 0600, each file created new (``O_EXCL | O_NOFOLLOW``), so a
link planted under a predictable name is never written through (``kvtrace/safe_files.py``).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvtrace.recording.exporters.delivery import Delivery, FailureLog, first_line
from kvtrace.recording.exporters.otlp_json import encode_request, utf8_line
from kvtrace.safe_files import create_private, private_dir

SPOOL_SUFFIX = ".jsonl"
_NAME_TRIES = 16
"""Names tried when the next file's name is taken (by a file, or a link someone planted)."""
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
        self.rotate_bytes = max(1, rotate_bytes)
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
        private_dir(self.directory)
        for attempt in range(_NAME_TRIES):
            self.path = self.directory / f"kvtrace-{self.process_tag()}-{self._seq:06d}{SPOOL_SUFFIX}"
            try:
                fd = create_private(self.path, os.O_WRONLY | os.O_APPEND)
                break
            except FileExistsError:
                if attempt == _NAME_TRIES - 1:
                    raise
                self._seq += 1
        self._size = 0
        self._fd = fd

    def _close_current(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            try:
                os.close(fd)
            except OSError:
                pass

    def write_line(self, data: bytes, timeout: Optional[float] = None) -> None:
        """Append ``data`` (one line, its newline included) whole, or raise and leave the file as it was
        (``timeout``: for the lock, seconds)."""
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError(f"the spool writer is busy (another write to {self.directory} hangs)")
        try:
            if self._fd is None or self._pid != os.getpid():
                self._open()
            elif self._size >= self.rotate_bytes:
                self._close_current()
                self._seq += 1
                self._open()
            line_start = self._size
            try:
                view = memoryview(data)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except BaseException:
                self._cut_back(line_start)
                raise
            self._size += len(data)
        finally:
            self._lock.release()

    def _cut_back(self, line_start: int) -> None:
        """After a failed write: remove its partial line (shrinking a file needs no free space)."""
        try:
            os.ftruncate(self._fd, line_start)
        except OSError:
            # Cannot cut it: leave this file with its torn tail (ingest quarantines it once this process
            # has ended) and start the next line in a new file, never glued to the torn one.
            self._close_current()
            self._seq += 1

    def close(self) -> None:
        with self._lock:
            self._close_current()


class SpoolExporter(SpanExporter):
    """SpanExporter that writes each batch as one OTLP/JSON line to the spool."""

    def __init__(self, directory: Path, rotate_bytes: int = 64 * 1024 * 1024):
        self.writer = SpoolWriter(directory, rotate_bytes)
        self._health = FailureLog(f"writing to the spool {self.writer.directory}")
        self.count_repairs: Callable[[int], None] = lambda repaired: None
        """Told how many values of a spooled batch were repaired (``SpanPipeline`` counts them)."""

    @property
    def spool_directory(self) -> Path:
        return self.writer.directory

    def deliver(self, spans: Sequence[ReadableSpan], timeout: Optional[float] = None) -> Delivery:
        if not spans:
            return Delivery.SPOOLED
        try:
            data, repaired = utf8_line(encode_request(spans, packed=True))
            self.writer.write_line(data, timeout)
        except Exception as exc:  # a full or read-only disk: counted, never raised into the host
            self._health.failed(first_line(exc), "those spans are counted as lost")
            return Delivery.LOST
        self._health.succeeded()
        if repaired:
            self.count_repairs(repaired)
        return Delivery.SPOOLED

    spool_directly = deliver

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE if self.deliver(spans) is Delivery.LOST else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.writer.close()
