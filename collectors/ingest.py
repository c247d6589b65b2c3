"""Spool → ClickHouse: idempotent, resumable ingest of OTLP/JSON span files.

* Idempotent: ``kvtrace_ingest_files`` remembers, per file, the byte offset up
  to which its lines are stored; a file is identified by its first line, so
  ingesting it again (or a copy of it) adds nothing.
* Resumable: a file still being written is taken up to its last complete
  line and continued from there next time.
* A truncated last line left by a writer that died (its pid is gone) is
  quarantined, as is any line that is not an OTLP trace request; the rest of
  the file is stored.  Nothing valid is lost.

Accepts kvtrace spool files and OTLP/JSON written by other tools (the
Collector's file exporter: one request per line; or one request per file,
pretty-printed).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from kvtrace.collectors.otlp_rows import COLUMNS, MalformedSpan, rows_from_request
from kvtrace.recording.exporters.spool import SPOOL_SUFFIX, spool_host, writer_of

CHUNK_BYTES = 8 * 1024 * 1024
TABLE = "otel_traces"
LOG_TABLE = "kvtrace_ingest_files"


@dataclass(frozen=True)
class FileProgress:
    """What ``kvtrace_ingest_files`` remembers of one file: bytes stored so far and running totals."""

    offset: int = 0
    complete: bool = False
    lines: int = 0
    spans: int = 0
    quarantined: int = 0


@dataclass
class FileResult:
    path: str
    spans: int = 0
    lines: int = 0
    quarantined: int = 0
    skipped: bool = False
    pending_bytes: int = 0
    messages: list[str] = field(default_factory=list)


@dataclass
class IngestReport:
    files: list[FileResult] = field(default_factory=list)

    @property
    def spans(self) -> int:
        return sum(f.spans for f in self.files)

    @property
    def quarantined(self) -> int:
        return sum(f.quarantined for f in self.files)

    @property
    def pending_bytes(self) -> int:
        return sum(f.pending_bytes for f in self.files)


def find_files(paths: Iterable[Path]) -> list[Path]:
    """Span files named by ``paths`` (files as given; directories: *.jsonl / *.json inside)."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            for child in sorted(path.iterdir()):
                if child.is_file() and child.suffix in (SPOOL_SUFFIX, ".json") and not child.name.startswith("."):
                    found.append(child)
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return found


def _is_pretty_printed(first_line: bytes) -> bool:
    """A multi-line JSON document starts with a line that is not a JSON value by itself."""
    stripped = first_line.strip()
    if not stripped.startswith(b"{"):
        return False
    try:
        json.loads(stripped)
    except ValueError:
        return stripped in (b"{",) or not stripped.endswith(b"}")
    return False


def _file_key(first_line: bytes) -> str:
    return hashlib.sha256(first_line).hexdigest()[:32]


def _writer_is_gone(path: Path) -> bool:
    """True when ``path`` is a kvtrace spool file whose writer process has ended."""
    writer = writer_of(path)
    if writer is None:
        return False
    host, pid = writer
    if host != spool_host():
        return False  # another machine's file: we cannot tell
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Ingestor:
    def __init__(self, client, quarantine_dir: Path, progress: Optional[Callable[[str], None]] = None):
        self.client = client
        self.quarantine_dir = Path(quarantine_dir)
        self.progress = progress or (lambda message: None)
        self._state = self._load_state()
        self._before = dict(self._state)  # progress at the start of this pass, per file

    def _load_state(self) -> dict[str, FileProgress]:
        rows = self.client.query(
            f"SELECT file_key, offset, complete, lines, spans, quarantined FROM {LOG_TABLE} FINAL").result_rows
        return {key: FileProgress(int(offset), bool(complete), int(lines), int(spans), int(quarantined))
                for key, offset, complete, lines, spans, quarantined in rows}

    def _save_state(self, key: str, path: Path, offset: int, result: FileResult, complete: bool) -> None:
        """Remember how far ``path`` is stored; counts are totals over every pass on the file."""
        before = self._before.get(key, FileProgress())
        progress = FileProgress(offset, complete, before.lines + result.lines, before.spans + result.spans,
                                before.quarantined + result.quarantined)
        self.client.insert(
            LOG_TABLE,
            [[key, str(path), offset, progress.lines, progress.spans, progress.quarantined, int(complete),
              time.time_ns() // 1000]],
            column_names=["file_key", "path", "offset", "lines", "spans", "quarantined", "complete", "updated"],
        )
        self._state[key] = progress

    def _quarantine(self, path: Path, line_no: int, text: bytes, error: str, result: FileResult) -> None:
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        target = self.quarantine_dir / f"{path.name}.quarantine.jsonl"
        record = {"file": str(path), "line": line_no, "error": error,
                  "text": text.decode("utf-8", errors="replace")}
        with open(target, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
        result.quarantined += 1
        result.messages.append(f"{path}:{line_no}: {error} (line moved to {target})")

    def ingest_file(self, path: Path) -> FileResult:
        result = FileResult(str(path))
        with open(path, "rb") as f:
            head = f.readline()
            if not head.endswith(b"\n"):
                return self._ingest_single_document(path, head + f.read(), result)
            if _is_pretty_printed(head):
                f.seek(0)
                data = f.read()
                if self._state.get(_file_key(data), FileProgress()).complete:
                    result.skipped = True
                    return result
                try:
                    json.loads(data)
                except ValueError:
                    pass  # not one document after all: take it line by line, quarantining what is bad
                else:
                    return self._ingest_single_document(path, data, result)
            key = _file_key(head)
            done = self._state.get(key, FileProgress())
            if done.complete:
                result.skipped = True
                return result
            offset = done.offset
            line_no = done.lines  # quarantine messages point at the file's real line numbers
            f.seek(offset)
            rows: list[list] = []
            carry = b""
            while True:
                chunk = f.read(CHUNK_BYTES)
                if not chunk:
                    break
                data = carry + chunk
                cut = data.rfind(b"\n")
                if cut < 0:
                    carry = data
                    continue
                carry = data[cut + 1:]
                for line in data[: cut + 1].splitlines():
                    line_no += 1
                    if line.strip():
                        self._parse_line(path, line_no, line, rows, result)
                    result.lines += 1
                # Store what was parsed, then remember how far we got: a crash between the two
                # re-ingests at most this chunk, never skips one.
                self._insert(rows)
                rows = []
                offset += cut + 1
                self._save_state(key, path, offset, result, False)
                self.progress(f"{path.name}: {result.spans} spans")
            complete = False
            if carry:
                if _writer_is_gone(path):
                    self._quarantine(path, line_no + 1, carry, "truncated last line (its writer ended before finishing it)", result)
                    offset += len(carry)
                    complete = True
                else:
                    result.pending_bytes = len(carry)
            elif _writer_is_gone(path):
                complete = True
            self._save_state(key, path, offset, result, complete)
        return result

    def _ingest_single_document(self, path: Path, data: bytes, result: FileResult) -> FileResult:
        """A file without newlines: either one pretty-printed request, or a first line still being written."""
        if not data.strip():
            return result
        key = _file_key(data)
        if self._state.get(key, FileProgress()).complete:
            result.skipped = True
            return result
        try:
            request = json.loads(data)
        except ValueError:
            if _writer_is_gone(path):
                self._quarantine(path, 1, data, "truncated line (its writer ended before finishing it)", result)
                self._save_state(key, path, len(data), result, True)
            else:
                result.pending_bytes = len(data)
            return result
        rows: list[list] = []
        try:
            rows.extend(rows_from_request(request))
        except MalformedSpan as exc:
            self._quarantine(path, 1, data, str(exc), result)
        self._insert(rows)
        result.spans += len(rows)
        result.lines = 1
        self._save_state(key, path, len(data), result, True)
        return result

    def _parse_line(self, path: Path, line_no: int, line: bytes, rows: list, result: FileResult) -> None:
        try:
            request = json.loads(line)
            parsed = list(rows_from_request(request))
        except (ValueError, MalformedSpan) as exc:
            self._quarantine(path, line_no, line, f"not an OTLP/JSON trace request: {exc}", result)
            return
        rows.extend(parsed)
        result.spans += len(parsed)

    def _insert(self, rows: list[list]) -> None:
        if rows:
            self.client.insert(TABLE, rows, column_names=COLUMNS)


def ingest_paths(client, paths: Iterable[Path], quarantine_dir: Optional[Path] = None,
                 progress: Optional[Callable[[str], None]] = None) -> IngestReport:
    """Ingest every span file under ``paths``.  Requires the schema (``kvtrace db init``)."""
    from kvtrace.config import default_spool_dir

    files = find_files(paths)
    ingestor = Ingestor(client, quarantine_dir or default_spool_dir() / "quarantine", progress)
    report = IngestReport()
    for index, path in enumerate(files, 1):
        ingestor.progress(f"[{index}/{len(files)}] {path.name}")
        report.files.append(ingestor.ingest_file(path))
    return report


def pending_files(spool_dir: Path, client) -> list[tuple[Path, int]]:
    """Spool files with bytes not yet ingested: (path, pending bytes)."""
    spool_dir = Path(spool_dir)
    if not spool_dir.is_dir():
        return []
    state = {key: offset for key, offset, _ in client.query(
        f"SELECT file_key, offset, complete FROM {LOG_TABLE} FINAL").result_rows}
    out = []
    for path in find_files([spool_dir]):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.readline()
        key = _file_key(head)
        done = state.get(key, 0)
        if size > done:
            out.append((path, size - done))
    return out
