"""Spool → ClickHouse: exactly-once, resumable ingest of OTLP/JSON span files (docs/storage.md).

A file is read in chunks of whole lines, each starting at a checkpoint and ending at the last line
end within ``CHUNK_BYTES`` (so a pass that re-reads a chunk after a stop makes the same one), parsed
once and written by ``store.store_rows``: kvtrace's typed tables, ``otel_traces`` (deduplicated by a
token of the chunk's lines), the lines' hashes (``kvtrace_ingest_lines``: a line met again in a copy or
another concatenation is counted in ``duplicates``, not stored), then the checkpoint
(``kvtrace_ingest_files``, keyed by the hashes of the first line and of the bytes before it).  What cannot
be stored is quarantined with ``FILE:LINE`` (the database's rejections found by splitting the chunk); a
value that does not fit is left out of its span and counted (``repaired``); a database that refuses
writes for a reason no line is to blame for raises ``IngestStopped``.  Only regular files are read from a
directory, never through a link, every read bounded.
"""

from __future__ import annotations

import errno
import functools
import gc
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

from kvtrace.collectors.checkpoints import Checkpoint, IngestLog, digest, key_of
from kvtrace.collectors.otlp_rows import MalformedSpan, SpanRow, rows_from_request
from kvtrace.collectors.quarantine import Quarantine
from kvtrace.collectors.schema import first_line
from kvtrace.collectors.span_files import find_files, passed_over_message, unwatched_because, writer_is_gone
from kvtrace.collectors.store import batch_token, store_rows, store_spans_lost_to_a_kill
from kvtrace.config import default_spool_dir
from kvtrace.errors import IngestStopped, UnreadableInput, UnusableInput
from kvtrace.safe_files import open_regular

CHUNK_BYTES = 32 * 1024 * 1024
"""Bytes read, parsed and stored at a time (one insert per table): fewer inserts are cheaper."""
MAX_LINE_BYTES = 256 * 1024 * 1024
"""A longer line (a spool line is one batch, far smaller) is quarantined by its first bytes and passed over."""
QUARANTINED_PREFIX_BYTES = 64 * 1024
KNOWN_LINES_SQL = "SELECT line_hash FROM kvtrace_ingest_lines WHERE line_hash IN {hashes:Array(String)}"


@dataclass
class FileResult:
    path: str
    spans: int = 0
    """Spans stored by this pass."""
    duplicates: int = 0
    """Spans of lines this pass read that were stored before (from this file or another), not stored again."""
    lines: int = 0
    quarantined: int = 0
    repaired: int = 0
    """Attribute values left out of their spans (an integer outside int64); the spans are stored."""
    skipped: bool = False
    pending_bytes: int = 0
    unreadable: bool = False
    messages: list[str] = field(default_factory=list)


@dataclass
class IngestReport:
    files: list[FileResult] = field(default_factory=list)
    passed_over: list[str] = field(default_factory=list)
    """``PATH (what it is)`` of every entry with a span file's name in a directory that is not a regular file."""

    def __getattr__(self, name: str) -> int:  # spans, duplicates, quarantined, repaired, pending_bytes
        if name in ("spans", "duplicates", "quarantined", "repaired", "pending_bytes"):
            return sum(getattr(f, name) for f in self.files)
        raise AttributeError(name)

    @property
    def messages(self) -> list[str]:
        passed = [passed_over_message(self.passed_over)] if self.passed_over else []
        return passed + [m for f in self.files for m in f.messages]


@dataclass
class _Line:
    number: int
    text: memoryview  # a view of the chunk read
    rows: list[SpanRow]
    hash: str = ""


def _is_pretty_printed(head: bytes) -> bool:
    """A multi-line JSON document starts with a line that is not a JSON value by itself: an object's first
    line that does not end it (a whole object ends with its closing brace)."""
    stripped = head.strip()
    return stripped.startswith(b"{") and (stripped == b"{" or not stripped.endswith(b"}"))


_REFUSAL_MARKERS = ("no space left", "not_enough_space", "not enough space", "cannot reserve", "disk quota",
                    "read-only file system", "readonly", "memory_limit_exceeded", "memory limit",
                    "too_many_parts", "connection refused", "connection reset", "broken pipe", "timed out",
                    "timeout", "network is unreachable", "socket")
_REFUSAL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOMEM)


def database_refuses_writes(exc: BaseException) -> bool:
    """True for errors no line is to blame for: a full or read-only disk, memory, a lost connection."""
    if isinstance(exc, OSError) and exc.errno in _REFUSAL_ERRNOS:
        return True
    if type(exc).__name__ in ("OperationalError", "StreamFailureError"):
        return True
    return any(marker in str(exc).lower() for marker in _REFUSAL_MARKERS)


class Ingestor:
    def __init__(self, client, quarantine_dir: Path, progress: Optional[Callable[[str], None]] = None):
        self.client = client
        self.quarantine = Quarantine(quarantine_dir)
        self.progress = progress or (lambda message: None)
        self.log = IngestLog(client)

    def ingest_file(self, path: Path, result: Optional[FileResult] = None) -> FileResult:
        result = result or FileResult(str(path))
        try:
            with open_regular(path) as f:  # found in a directory anyone may write to: never through a link
                self._ingest_open_file(path, f, result)
        except OSError as exc:  # the span file itself (the quarantine copy handles its own errors)
            result.unreadable = True
            result.messages.append(f"{path}: cannot read it: {exc.strerror or exc}; the rest is ingested")
        return result

    def _ingest_open_file(self, path: Path, f, result: FileResult) -> None:
        size = os.fstat(f.fileno()).st_size
        head = f.readline(MAX_LINE_BYTES + 1)
        if not head.endswith(b"\n") and len(head) <= MAX_LINE_BYTES:  # the whole file
            return self._ingest_single_document(path, head, result)
        if _is_pretty_printed(head):
            f.seek(0)
            data = f.read(MAX_LINE_BYTES + 1)
            try:
                if len(data) > MAX_LINE_BYTES:
                    raise ValueError("too long for one document")
                json.loads(data)
            except ValueError:
                pass  # not one document after all: take it line by line, quarantining what is bad
            else:
                return self._ingest_single_document(path, data, result)
        head_key = digest(head)
        start, hasher = self._resume_point(f, size, head_key)
        if start is not None and start.offset == size:
            # Nothing new since the last pass.  A spool file whose writer has ended since is finished.
            if not start.complete and writer_is_gone(path):
                self.log.save(replace(start, complete=True), path)
            result.skipped = True
            return
        start = start or Checkpoint(head_key)
        offset, line_no, before = start.offset, start.lines, (start.lines, start.spans, start.quarantined)
        first = True  # the pass's first chunk stored: the one a killed pass may have left half-stored
        while True:
            f.seek(offset)
            data = f.read(CHUNK_BYTES)
            cut = data.rfind(b"\n")
            while cut < 0 and len(data) <= MAX_LINE_BYTES and (more := f.read(CHUNK_BYTES)):  # a long line
                cut = len(data) + more.find(b"\n") if b"\n" in more else -1
                data += more
            if cut < 0 and len(data) > MAX_LINE_BYTES:
                line_no += 1
                result.lines += 1
                self._quarantine(path, line_no, data[:QUARANTINED_PREFIX_BYTES], f"a line longer than "
                                 f"{MAX_LINE_BYTES:,} bytes (its first {QUARANTINED_PREFIX_BYTES:,} are kept here)", result)
                offset += self._pass_line(f, data, hasher)
                continue
            if cut < 0:
                break
            view, parsed, start, collecting = memoryview(data), [], 0, gc.isenabled()
            gc.disable()  # a chunk's rows make no reference cycles: the collector would walk them for nothing
            try:
                while start <= cut:  # lines as views of the chunk, not copies; a "\r" before "\n" left out
                    end = data.index(b"\n", start)
                    stop = end - 1 if end > start and data[end - 1] == 13 else end
                    line_no += 1
                    result.lines += 1
                    if stop > start and not (data[start] in b" \t\r\x0b\x0c" and data[start:stop].isspace()):
                        self._parse(path, line_no, view[start:stop], parsed, result)
                    start = end + 1
                self._store(path, parsed, result, first_of_pass=first)
                first = False
            finally:
                if collecting:
                    gc.enable()
            hasher.update(view[: cut + 1])
            offset += cut + 1
            if offset < size:  # at the file's end the save after the loop follows at once: one insert, not two
                self._save(path, head_key, hasher, offset, before, result, complete=False)
            self.progress(f"{path.name}: {result.spans} spans")
        complete = writer_is_gone(path)
        if data and complete:
            self._quarantine(path, line_no + 1, data, "truncated last line (its writer ended before finishing it)",
                             result)
            result.lines += 1
            hasher.update(data)
            offset += len(data)
        elif data:
            self._left_pending(path, len(data), result)
        self._save(path, head_key, hasher, offset, before, result, complete)

    def _resume_point(self, f, size: int, head: str):
        """The furthest checkpoint of this first line that this file's own bytes match, and a hash of the
        file up to it (to be continued); ``(None, hash of nothing)`` when none matches.  One exactly at the
        file's size (every finished spool file on every pass) is taken without reading the file."""
        checkpoints = self.log.checkpoints(head)
        for checkpoint in checkpoints:
            if checkpoint.offset == size:
                return checkpoint, None
        hasher = hashlib.sha256()
        best, best_hasher = None, hasher.copy()
        position, last_byte = 0, b""
        f.seek(0)
        for checkpoint in sorted((c for c in checkpoints if 0 < c.offset < size), key=lambda c: c.offset):
            while position < checkpoint.offset and (block := f.read(min(1 << 20, checkpoint.offset - position))):
                hasher.update(block)
                position += len(block)
                last_byte = block[-1:]
            if position != checkpoint.offset:
                break
            # An old first-line-only checkpoint is trusted at a line end.
            if key_of(hasher) == checkpoint.prefix if checkpoint.prefix else last_byte == b"\n":
                best, best_hasher = checkpoint, hasher.copy()
        return best, best_hasher

    @staticmethod
    def _pass_line(f, data: bytes, hasher) -> int:
        """Hash the rest of an over-long line starting with ``data`` without keeping it; its length."""
        hasher.update(data)
        length = len(data)
        while block := f.read(CHUNK_BYTES):
            end = block.find(b"\n")
            part = block if end < 0 else block[: end + 1]
            hasher.update(part)
            length += len(part)
            if end >= 0:
                break
        return length

    def _save(self, path: Path, head: str, hasher, offset: int, before: tuple[int, int, int], result: FileResult,
              complete: bool) -> None:
        lines, spans, quarantined = before
        self.log.save(Checkpoint(head, key_of(hasher), offset, complete, lines + result.lines,
                                 spans + result.spans, quarantined + result.quarantined), path)

    def _ingest_single_document(self, path: Path, data: bytes, result: FileResult) -> None:
        """A file without newlines: either one pretty-printed request, or a first line still being written."""
        document = hashlib.sha256(data)
        key = key_of(document)  # digest(data): the first line is the whole document
        if not data.strip() or any(c.offset == len(data) and c.complete for c in self.log.checkpoints(key)):
            result.skipped = bool(data.strip())
            return
        try:
            json.loads(data)
        except ValueError:
            if not writer_is_gone(path):
                self._left_pending(path, len(data), result)
                return
            self._quarantine(path, 1, data, "truncated line (its writer ended before finishing it)", result)
        else:
            parsed: list[_Line] = []
            self._parse(path, 1, data, parsed, result)
            self._store(path, parsed, result, first_of_pass=True)
        result.lines = 1
        self._save(path, key, document, len(data), (0, 0, 0), result, True)

    def _parse(self, path: Path, line_no: int, line, parsed: list[_Line], result: FileResult) -> None:
        """A line's rows into ``parsed``, or the line into quarantine when it is no OTLP trace request."""
        dropped: list[str] = []
        try:
            rows = rows_from_request(line, typed=True, dropped=dropped)
        except MalformedSpan as exc:
            return self._quarantine(path, line_no, line, str(exc), result)
        if dropped and not result.repaired:  # the first of a file is named; every one is counted
            result.messages.append(f"{path}:{line_no}: attribute {dropped[0][:80]!r} holds an integer outside the "
                                   "64-bit range: left out of its span, which is stored (every such value is "
                                   "counted in `repaired`)")
        result.repaired += len(dropped)
        parsed.append(_Line(line_no, line, rows, digest(line)))

    @functools.cached_property
    def _kill_may_lose_rows(self) -> bool:
        """Whether ``otel_traces`` is a non-replicated MergeTree, whose deduplication a kill can leave with a
        block's token but not its rows (``store_spans_lost_to_a_kill``); a cluster's replicated tables record
        the two together, and rows queued for its shards are not yet readable."""
        return self.client.query(
            "SELECT engine FROM system.tables WHERE database = currentDatabase() AND name = 'otel_traces'"
        ).result_rows == [("MergeTree",)]

    @staticmethod
    def _left_pending(path: Path, size: int, result: FileResult) -> None:
        """A tail without newline is left for a later pass; where no writer can be watched ending, say how to end it."""
        result.pending_bytes = size
        why = unwatched_because(path)
        if why:
            result.messages.append(
                f"{path}: its last {size:,} byte(s) end in no newline and are left for a later pass: a line is read "
                f"once it ends, and whether anything still writes this file cannot be told ({why}). If nothing "
                "does, end it with a newline and ingest again: that line is then stored or quarantined")

    def _quarantine(self, path: Path, line_no: int, text: bytes, reason: str, result: FileResult) -> None:
        where = self.quarantine.add(path, line_no, text, reason)
        result.quarantined += 1
        result.messages.append(f"{path}:{line_no}: {reason} ({where})")

    def _store(self, path: Path, lines: list[_Line], result: FileResult, first_of_pass: bool) -> None:
        """Store the lines not stored before (here or in another file); a line twice in a chunk once."""
        try:
            known = {row[0] for row in self.client.query(
                KNOWN_LINES_SQL, parameters={"hashes": sorted({line.hash for line in lines})}).result_rows}
        except Exception as exc:  # noqa: BLE001 - a database that cannot answer cannot be written either
            raise IngestStopped(f"the database could not say which lines it holds: {first_line(exc)}") from None
        fresh = []
        for line in lines:
            if line.hash in known:
                result.duplicates += len(line.rows)
            else:
                known.add(line.hash)
                fresh.append(line)
        self._insert(path, fresh, result, first_of_pass)

    def _insert(self, path: Path, lines: list[_Line], result: FileResult, first_of_pass: bool) -> None:
        if not lines:
            return
        rows = [row for line in lines for row in line.rows]
        try:
            token = batch_token("".join(line.hash for line in lines).encode())
            store_rows(self.client, rows, token)
            if first_of_pass and self._kill_may_lose_rows:
                store_spans_lost_to_a_kill(self.client, rows, token)
            self.client.insert("kvtrace_ingest_lines", [[line.hash] for line in lines], column_names=["line_hash"])
        except Exception as exc:  # noqa: BLE001 - Arrow and the client raise whatever a value makes them raise
            if database_refuses_writes(exc):
                raise IngestStopped(f"the database stopped accepting spans: {first_line(exc)}") from None
            if len(lines) == 1:
                return self._quarantine(path, lines[0].number, lines[0].text,
                                        f"the database rejected it: {first_line(exc)}", result)
            middle = len(lines) // 2  # split until the lines to blame are found
            self._insert(path, lines[:middle], result, first_of_pass)
            return self._insert(path, lines[middle:], result, first_of_pass)
        result.spans += len(rows)


def ingest_paths(client, paths: Iterable[Path], quarantine_dir: Optional[Path] = None,
                 progress: Optional[Callable[[str], None]] = None) -> IngestReport:
    """Ingest every span file under ``paths`` (the schema must exist: ``kvtrace db init``).

    Raises ``UnusableInput`` / ``UnreadableInput`` for a path argument that cannot be ingested, and
    ``IngestStopped`` (the report so far as ``.report``) when the database stops accepting spans.  A file
    that cannot be read is reported in its result's messages and passed over.
    """
    report = IngestReport()
    files = find_files(paths, report.passed_over)
    try:
        ingestor = Ingestor(client, quarantine_dir or default_spool_dir() / "quarantine", progress)
        for index, path in enumerate(files, 1):
            ingestor.progress(f"[{index}/{len(files)}] {path.name}")
            report.files.append(FileResult(str(path)))  # before: a stop mid-file still counts its spans
            ingestor.ingest_file(path, report.files[-1])
    except Exception as exc:  # noqa: BLE001 - also the progress log itself, which could not be read or written
        if not isinstance(exc, IngestStopped) and not database_refuses_writes(exc):
            raise
        stopped = exc if isinstance(exc, IngestStopped) else IngestStopped(
            f"the database stopped accepting spans: {first_line(exc)}")
        stopped.report = report
        raise stopped from None
    return report


def pending_files(spool_dir: Path, client, problems: Optional[list[str]] = None) -> list[tuple[Path, int]]:
    """Spool files with bytes not yet ingested: (path, pending bytes), judged by size against the furthest
    checkpoint of each file's first line without reading on (``db status`` stays cheap).  What cannot be
    read (the directory, a file, a link or FIFO in it) is added to ``problems``; a spool not made yet is empty."""
    spool_dir, problems, passed_over = Path(spool_dir), [] if problems is None else problems, []
    try:
        files = find_files([spool_dir], passed_over)
    except (UnusableInput, UnreadableInput) as exc:
        if isinstance(exc, UnreadableInput) or spool_dir.exists() or spool_dir.is_symlink():
            problems.append(str(exc))
        return []
    problems.extend(f"{entry}: not read" for entry in passed_over)
    log, out = IngestLog(client), []
    for path in files:
        try:
            with open_regular(path) as f:
                size, head = os.fstat(f.fileno()).st_size, f.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            problems.append(f"{path}: cannot read it: {exc.strerror or exc}")
            continue
        done = max((c.offset for c in log.checkpoints(digest(head)) if c.offset <= size), default=0)
        if size > done:
            out.append((path, size - done))
    return out
