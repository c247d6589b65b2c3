"""Spool → ClickHouse: exactly-once, resumable ingest of OTLP/JSON span files.

* **Exactly once.**  A span is stored once per (TraceId, SpanId): before a
  chunk is inserted, the spans of it that are already stored are dropped (one
  query over the chunk's time window).  So a pass that died between an insert
  and its progress record, a copy of a file, or a concatenation of files that
  were stored before adds nothing twice.
* **Files are known by content.**  ``kvtrace_ingest_files`` keeps checkpoints
  keyed ``<hash of the first line>:<hash of bytes [0, offset)>``.  A pass
  resumes a file from the furthest checkpoint whose prefix hash matches the
  file's own bytes; a file that only shares its first line with one stored
  before (``cat a.jsonl b.jsonl > merged.jsonl``) is read from wherever its
  bytes stop matching, so its new spans are stored.  A file whose size equals
  a checkpoint of a complete file with the same first line is taken as
  unchanged without reading it (so a spool of finished files costs nothing).
* **Resumable.**  A file still being written is taken up to its last complete
  line and continued from there next time; a truncated last line left by a
  writer that died (its pid is gone) is quarantined.
* **Quarantine, never crash.**  A line that cannot become rows (not JSON, not
  an OTLP trace request, a wrong shape or type, an id or time out of range, a
  line longer than ``MAX_LINE_BYTES``) or that the database rejects (the chunk
  is split until the lines to blame are found) is copied to the quarantine
  directory (files 0600) with ``FILE:LINE`` and the reason; the rest of the
  file is stored.  One value is no reason to lose a line that may hold many
  requests: an attribute whose integer is outside int64 is left out of its
  span, and counted (``FileResult.repaired``).
* **The spool directory is not trusted.**  Only regular files are read from a
  directory, never through a symbolic link; anything else with a span file's
  name is passed over and named (``IngestReport.passed_over``).  Every read is
  bounded (``MAX_LINE_BYTES`` per line).
* **Stops cleanly.**  When the database refuses writes for a reason no line
  is to blame for (full disk, lost connection), ``IngestStopped`` says so in
  one line.  Everything stored until then is kept and the next pass goes on
  from there.

* **Request spans through the database's own formatting.**  ``otel_traces``
  gets every span as the Collector's exporter would write it.  Request spans
  whose per-token arrays are plain numbers (always so in this version's spool,
  which packs them) are handed over once, arrays packed, to the Null table
  ``kvtrace_request_spans``: its views write the ``otel_traces`` row (the
  database makes the arrays' JSON text) and the ``kvtrace_requests`` row (the
  arrays as numbers); the insert names itself (``log_comment``) so the JSON
  view passes those spans over.  The two views run in no set order, so a stop
  in between can leave a span in either table alone: in ``otel_traces``,
  ``view_completion`` writes its missing view rows through the JSON view, to
  the same values; in ``kvtrace_requests`` alone, its ``otel_traces`` row is
  written from Python.  Databases on a cluster, or whose schema predates this,
  get every span through ``otel_traces`` and the JSON view, its text made here.

Accepts kvtrace spool files and OTLP/JSON written by other tools (the
Collector's file exporter: one request per line; or one request per file,
pretty-printed).
"""

from __future__ import annotations

import errno
import gc
import hashlib
import io
import json
import logging
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

from kvtrace.collectors.otlp_rows import COLUMNS, MalformedSpan, SpanRow, collector_row, rows_from_request
from kvtrace.collectors.schema import TYPED_INGEST_COMMENT, TYPED_REQUESTS_TABLE, TYPED_REQUESTS_VIEWS
from kvtrace.collectors.view_completion import complete_views
from kvtrace.config import default_spool_dir
from kvtrace.errors import IngestStopped, UnreadableInput, UnusableInput
from kvtrace.recording.exporters.spool import SPOOL_SUFFIX, spool_host, writer_of
from kvtrace.recording.packed_arrays import PACKED_ARRAYS, TOKEN_ARRAYS, pack
from kvtrace.safe_files import append_private, open_regular, private_dir, regular_entries

CHUNK_BYTES = 32 * 1024 * 1024
"""Bytes read, parsed and inserted at a time: each insert fires the views once, so fewer is cheaper."""
MAX_LINE_BYTES = 256 * 1024 * 1024
"""A longer line (a spool line is one batch, far smaller) is quarantined by its first bytes and passed over."""
QUARANTINED_PREFIX_BYTES = 64 * 1024
"""What the quarantine keeps of a line too long to keep whole."""
SPAN_FILE_SUFFIXES = (SPOOL_SUFFIX, ".json")
TABLE = "otel_traces"
LOG_TABLE = "kvtrace_ingest_files"
LOG_COLUMNS = ["file_key", "path", "offset", "lines", "spans", "quarantined", "complete", "updated"]
STORED_CHECK_BATCH = 4000
"""Span ids per already-stored query (they travel as one bound array parameter)."""

_TIMESTAMP, _TRACE_ID, _SPAN_ID = COLUMNS.index("Timestamp"), COLUMNS.index("TraceId"), COLUMNS.index("SpanId")

TYPED_COLUMNS = [*COLUMNS, *(f"packed_{column}" for column in TOKEN_ARRAYS.values())]
"""Columns of ``kvtrace_request_spans``: ``otel_traces``' own and each per-token array packed."""
REQUESTS_TABLE = "kvtrace_requests"
_TYPED_VIEW_SQL = (
    "SELECT name, engine, as_select FROM system.tables WHERE database = currentDatabase() "
    "AND (name IN ('kvtrace_requests', 'kvtrace_requests_mv', {typed:String}) OR has({views:Array(String)}, name))")

STORED_SPANS_SQL = (
    "SELECT TraceId, SpanId FROM {table:Identifier} "
    "WHERE Timestamp >= fromUnixTimestamp64Nano({earliest:Int64}) "
    "AND Timestamp <= fromUnixTimestamp64Nano({latest:Int64}) "
    "AND SpanId IN (SELECT arrayJoin({span_ids:Array(String)}))"
)


@dataclass(frozen=True)
class Checkpoint:
    """One row of ``kvtrace_ingest_files``: a file's bytes [0, offset) are stored, with running totals.

    ``prefix`` is the hash of those bytes; rows written before checkpoints carried it have none, and
    are trusted by their first line alone as they were then.
    """

    head: str
    prefix: str = ""
    offset: int = 0
    complete: bool = False
    lines: int = 0
    spans: int = 0
    quarantined: int = 0

    @property
    def key(self) -> str:
        return f"{self.head}:{self.prefix}" if self.prefix else self.head


@dataclass
class FileResult:
    path: str
    spans: int = 0
    """Spans stored by this pass."""
    duplicates: int = 0
    """Spans this pass read that were already stored (from this file or another), so not stored again."""
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

    @property
    def spans(self) -> int:
        return sum(f.spans for f in self.files)

    @property
    def duplicates(self) -> int:
        return sum(f.duplicates for f in self.files)

    @property
    def quarantined(self) -> int:
        return sum(f.quarantined for f in self.files)

    @property
    def repaired(self) -> int:
        return sum(f.repaired for f in self.files)

    @property
    def pending_bytes(self) -> int:
        return sum(f.pending_bytes for f in self.files)

    @property
    def messages(self) -> list[str]:
        passed = [passed_over_message(self.passed_over)] if self.passed_over else []
        return passed + [m for f in self.files for m in f.messages]


PASSED_OVER_NAMED = 5
"""Entries a passed-over message names before it gives the count of the rest."""


def passed_over_message(passed_over: list[str]) -> str:
    """One line for the entries of a span directory that were not read (links, FIFOs, devices)."""
    named = ", ".join(passed_over[:PASSED_OVER_NAMED])
    rest = f" and {len(passed_over) - PASSED_OVER_NAMED} more" if len(passed_over) > PASSED_OVER_NAMED else ""
    return (f"{len(passed_over)} entr{'y' if len(passed_over) == 1 else 'ies'} passed over, never read: "
            f"only regular files are ingested from a directory ({named}{rest})")


@dataclass
class _Line:
    """A parsed line of a chunk and the rows it gives."""

    number: int
    text: bytes
    rows: list[SpanRow]


def find_files(paths: Iterable[Path], passed_over: Optional[list[str]] = None) -> list[Path]:
    """Span files named by ``paths`` (files as given; directories: *.jsonl / *.json inside).

    A path that names no file or directory, or something that is not a regular file (a device such
    as /dev/null, a FIFO, a socket), is a usage mistake (``UnusableInput``); a directory that cannot
    be listed or a file that cannot be opened is ``UnreadableInput``.  A file named through a symbolic
    link is the file it points to: the caller chose it.  Inside a directory only regular files count;
    every other entry with a span file's name (a link, a FIFO, a device) is added to ``passed_over``.
    """
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise UnusableInput(f"{path}: no such file or directory") from None
        except OSError as exc:
            raise UnreadableInput(f"{path}: cannot read it: {exc.strerror or exc}") from None
        if stat.S_ISDIR(mode):
            try:
                regular, others = regular_entries(path, SPAN_FILE_SUFFIXES)
            except OSError as exc:
                raise UnreadableInput(f"{path}: cannot list the directory: {exc.strerror or exc}") from None
            found.extend(regular)
            if passed_over is not None:
                passed_over.extend(f"{entry} ({what})" for entry, what in others)
        elif stat.S_ISREG(mode):
            path = Path(os.path.realpath(path)) if path.is_symlink() else path
            try:
                open_regular(path).close()
            except OSError as exc:
                raise UnreadableInput(f"{path}: cannot read it: {exc.strerror or exc}") from None
            found.append(path)
        else:
            raise UnusableInput(f"{path} is not a regular file or a directory; ingest reads OTLP/JSON span "
                                "files (.jsonl, .json) or directories of them")
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


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


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
    except (PermissionError, OverflowError):
        return False
    return False


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
    text = str(exc).lower()
    return any(marker in text for marker in _REFUSAL_MARKERS)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


@contextmanager
def _cycle_collection_paused():
    """Parsing a chunk allocates millions of objects and frees none of them (every span's row is kept
    until the chunk is stored, and storing builds its columns), which makes Python's cycle collector
    walk the growing chunk again and again for nothing: a fifth of the parse's CPU.  JSON makes no
    reference cycles, so the collector waits until the chunk is stored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _quiet_serializer():
    """clickhouse-connect logs a traceback for every row it cannot serialize; ingest reports those itself."""
    logger = logging.getLogger("clickhouse_connect.driver.transform")
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


class IngestLog:
    """Checkpoints in ``kvtrace_ingest_files``, grouped by the hash of each file's first line."""

    def __init__(self, client):
        self.client = client
        self._by_head: dict[str, dict[str, Checkpoint]] = {}
        rows = client.query(
            f"SELECT file_key, offset, complete, lines, spans, quarantined FROM {LOG_TABLE} FINAL").result_rows
        for key, offset, complete, lines, spans, quarantined in rows:
            head, _, prefix = str(key).partition(":")
            self._remember(Checkpoint(head, prefix, int(offset), bool(complete), int(lines), int(spans),
                                      int(quarantined)))

    def _remember(self, checkpoint: Checkpoint) -> None:
        self._by_head.setdefault(checkpoint.head, {})[checkpoint.key] = checkpoint

    def checkpoints(self, head: str) -> list[Checkpoint]:
        """This first line's checkpoints, furthest first."""
        return sorted(self._by_head.get(head, {}).values(), key=lambda c: -c.offset)

    def save(self, checkpoint: Checkpoint, path: Path) -> None:
        self.client.insert(
            LOG_TABLE,
            [[checkpoint.key, str(path), checkpoint.offset, checkpoint.lines, checkpoint.spans,
              checkpoint.quarantined, int(checkpoint.complete), time.time_ns() // 1000]],
            column_names=LOG_COLUMNS,
        )
        self._remember(checkpoint)


class _Quarantine:
    """Copies of rejected lines, one JSON record each, in ``<dir>/<file name>.quarantine.jsonl``.

    A line already copied (a pass that re-reads after a crash) is not copied twice.  When the copy
    cannot be written (the disk is full) the line is still reported and counted: it stays in its
    own file, which ingest never changes.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._recorded: dict[Path, set[tuple[str, int]]] = {}

    def target(self, source: Path) -> Path:
        return self.directory / f"{source.name}.quarantine.jsonl"

    def _already(self, target: Path) -> set[tuple[str, int]]:
        if target not in self._recorded:
            seen: set[tuple[str, int]] = set()
            for record in read_quarantine_file(target):
                seen.add((record.get("file"), record.get("line")))
            self._recorded[target] = seen
        return self._recorded[target]

    def add(self, source: Path, line_no: int, text: bytes, reason: str) -> str:
        """Copy the line; returns where it went (or why it could not be copied), for the message."""
        target = self.target(source)
        try:
            seen = self._already(target)
            if (str(source), line_no) not in seen:
                private_dir(self.directory, link_ok=False)
                record = {"file": str(source), "line": line_no, "error": reason,
                          "text": text.decode("utf-8", errors="replace")}
                with os.fdopen(append_private(target), "a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
                seen.add((str(source), line_no))
        except OSError as exc:
            return f"line kept only in {source.name}: the quarantine copy failed: {exc.strerror or exc}"
        return f"line moved to {target}"


def read_quarantine_file(path: Path) -> list[dict]:
    """The records of one quarantine file (unreadable records and files, and anything but a regular file,
    are passed over)."""
    records = []
    try:
        with io.TextIOWrapper(open_regular(path), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    except OSError:
        pass
    return records


def quarantined_lines(quarantine_dir: Path, problems: Optional[list[str]] = None) -> list[dict]:
    """Every quarantined line under ``quarantine_dir``: {file, line, error} (text left out).  What cannot be
    read (the directory, a link or FIFO in it) is added to ``problems``."""
    problems = [] if problems is None else problems
    out = []
    try:
        targets, others = regular_entries(Path(quarantine_dir), (".quarantine.jsonl",), link_ok=False)
    except FileNotFoundError:
        return out
    except OSError as exc:
        problems.append(f"{quarantine_dir}: cannot list it: {exc.strerror or exc}")
        return out
    for entry, what in others:
        problems.append(f"{entry} ({what}): not read")
    for target in targets:
        for record in read_quarantine_file(target):
            out.append({"file": str(record.get("file", "")), "line": record.get("line"),
                        "error": str(record.get("error", ""))})
    return out


class Ingestor:
    def __init__(self, client, quarantine_dir: Path, progress: Optional[Callable[[str], None]] = None):
        self.client = client
        self.quarantine = _Quarantine(quarantine_dir)
        self.progress = progress or (lambda message: None)
        self.log = IngestLog(client)
        self.typed_requests = typed_requests_available(client)

    # --- one file ----------------------------------------------------------------------

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
            self._ingest_single_document(path, head, result)
            return
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
                self._ingest_single_document(path, data, result)
                return
        head_key = _digest(head)
        start, hasher = self._resume_point(f, size, head_key)
        if start is not None and start.offset == size:
            # Nothing new since the last pass.  A spool file whose writer has ended since is finished.
            if not start.complete and _writer_is_gone(path):
                self.log.save(replace(start, complete=True), path)
            result.skipped = True
            return
        start = start or Checkpoint(head_key)
        offset, line_no = start.offset, start.lines
        before = (start.lines, start.spans, start.quarantined)
        f.seek(offset)
        carry = b""
        passing = False  # inside a line longer than MAX_LINE_BYTES: its bytes are hashed, not kept
        while True:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                break
            if passing:
                end = chunk.find(b"\n")
                passed = chunk if end < 0 else chunk[: end + 1]
                hasher.update(passed)
                offset += len(passed)
                if end < 0:
                    continue
                passing, chunk = False, chunk[end + 1:]
            data = carry + chunk
            cut = data.rfind(b"\n")
            if cut < 0:
                carry = data
                if len(carry) > MAX_LINE_BYTES:
                    line_no += 1
                    result.lines += 1
                    self._quarantine(path, line_no, carry[:QUARANTINED_PREFIX_BYTES],
                                     f"a line longer than {MAX_LINE_BYTES:,} bytes (its first "
                                     f"{QUARANTINED_PREFIX_BYTES:,} are kept here)", result)
                    hasher.update(carry)
                    offset += len(carry)
                    carry, passing = b"", True
                continue
            carry = data[cut + 1:]
            parsed = []
            with _cycle_collection_paused():
                for line in data[: cut + 1].splitlines():
                    line_no += 1
                    result.lines += 1
                    if line and not line.isspace():
                        self._parse_line(path, line_no, line, parsed, result)
                self._store(path, parsed, result)
            # Progress only after the rows are stored: a crash in between re-reads this chunk next
            # time, and the already-stored check keeps its spans from being stored twice.
            hasher.update(memoryview(data)[: cut + 1])
            offset += cut + 1
            self._save(path, head_key, hasher, offset, before, result, complete=False)
            self.progress(f"{path.name}: {result.spans} spans")
        complete = False
        if carry:
            if _writer_is_gone(path):
                self._quarantine(path, line_no + 1, carry, "truncated last line (its writer ended before finishing it)",
                                 result)
                result.lines += 1
                hasher.update(carry)
                offset += len(carry)
                complete = True
            else:
                result.pending_bytes = len(carry)
        elif _writer_is_gone(path):
            complete = True
        self._save(path, head_key, hasher, offset, before, result, complete)

    def _resume_point(self, f, size: int, head: str):
        """The furthest checkpoint of this first line that this file's own bytes match, and a hash of
        the file up to it (to be continued); ``(None, hash of nothing)`` when none matches.

        A checkpoint exactly at the file's size is taken without reading the file (see the module
        doc): that is every finished spool file on every pass.
        """
        checkpoints = self.log.checkpoints(head)
        for checkpoint in checkpoints:
            if checkpoint.offset == size:
                return checkpoint, None
        usable = sorted((c for c in checkpoints if 0 < c.offset < size), key=lambda c: c.offset)
        hasher = hashlib.sha256()
        best, best_hasher = None, hasher.copy()
        position, last_byte = 0, b""
        f.seek(0)
        for checkpoint in usable:
            while position < checkpoint.offset:
                block = f.read(min(1 << 20, checkpoint.offset - position))
                if not block:
                    break
                hasher.update(block)
                position += len(block)
                last_byte = block[-1:]
            if position != checkpoint.offset:
                break
            if checkpoint.prefix:
                matches = hasher.hexdigest()[:32] == checkpoint.prefix
            else:
                matches = last_byte == b"\n"  # an old first-line-only checkpoint: trusted at a line end
            if matches:
                best, best_hasher = checkpoint, hasher.copy()
        return best, best_hasher

    def _save(self, path: Path, head: str, hasher, offset: int, before: tuple[int, int, int], result: FileResult,
              complete: bool) -> None:
        lines, spans, quarantined = before
        self.log.save(Checkpoint(head, hasher.hexdigest()[:32], offset, complete, lines + result.lines,
                                 spans + result.spans, quarantined + result.quarantined), path)

    def _ingest_single_document(self, path: Path, data: bytes, result: FileResult) -> None:
        """A file without newlines: either one pretty-printed request, or a first line still being written."""
        if not data.strip():
            return
        key = _digest(data)
        if any(c.offset == len(data) and c.complete for c in self.log.checkpoints(key)):
            result.skipped = True
            return
        document = hashlib.sha256(data)
        try:
            request = json.loads(data)
        except ValueError:
            if _writer_is_gone(path):
                result.lines = 1
                self._quarantine(path, 1, data, "truncated line (its writer ended before finishing it)", result)
                self._save(path, key, document, len(data), (0, 0, 0), result, True)
            else:
                result.pending_bytes = len(data)
            return
        result.lines = 1
        dropped: list[str] = []
        try:
            rows = rows_from_request(request, packed=self.typed_requests, dropped=dropped)
        except MalformedSpan as exc:
            self._quarantine(path, 1, data, f"not an OTLP/JSON trace request: {exc}", result)
        else:
            self._count_dropped(path, 1, dropped, result)
            self._store(path, [_Line(1, data, rows)], result)
        self._save(path, key, document, len(data), (0, 0, 0), result, True)

    def _parse_line(self, path: Path, line_no: int, line: bytes, parsed: list[_Line], result: FileResult) -> None:
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as exc:
            self._quarantine(path, line_no, line, f"not JSON: {exc}", result)
            return
        dropped: list[str] = []
        try:
            rows = rows_from_request(request, packed=self.typed_requests, dropped=dropped)
        except MalformedSpan as exc:
            self._quarantine(path, line_no, line, f"not an OTLP/JSON trace request: {exc}", result)
            return
        self._count_dropped(path, line_no, dropped, result)
        parsed.append(_Line(line_no, line, rows))

    @staticmethod
    def _count_dropped(path: Path, line_no: int, dropped: list[str], result: FileResult) -> None:
        """Count attribute values left out of their spans; the first of a file is named in a message."""
        if not dropped:
            return
        if not result.repaired:
            result.messages.append(f"{path}:{line_no}: attribute {dropped[0][:80]!r} holds an integer outside the "
                                   "64-bit range: left out of its span, which is stored (every such value is "
                                   "counted in `repaired`)")
        result.repaired += len(dropped)

    def _quarantine(self, path: Path, line_no: int, text: bytes, reason: str, result: FileResult) -> None:
        where = self.quarantine.add(path, line_no, text, reason)
        result.quarantined += 1
        result.messages.append(f"{path}:{line_no}: {reason} ({where})")

    # --- storing rows exactly once -----------------------------------------------------------

    def _store(self, path: Path, lines: list[_Line], result: FileResult) -> None:
        """Insert the rows of ``lines`` that are not stored yet; quarantine lines the database rejects."""
        seen: set[tuple[str, str]] = set()
        for line in lines:  # the same span twice in one chunk: keep the first
            kept = []
            for row in line.rows:
                ident = (row[_TRACE_ID], row[_SPAN_ID])
                if ident[1] and ident in seen:
                    result.duplicates += 1
                    continue
                seen.add(ident)
                kept.append(row)
            line.rows = kept
        self._insert_lines(path, lines, result)

    def _insert_lines(self, path: Path, lines: list[_Line], result: FileResult) -> None:
        self._drop_stored(path, lines, result)
        lines = [line for line in lines if line.rows]
        rows = [row for line in lines for row in line.rows]
        if not rows:
            return
        try:
            with _quiet_serializer():
                self._insert_rows(path, rows, result)
        except IngestStopped:
            raise
        except Exception as exc:  # noqa: BLE001 - the client raises anything its serializers raise
            if database_refuses_writes(exc):
                raise IngestStopped(f"the database stopped accepting spans: {first_line(exc)}") from None
            if len(lines) == 1:
                line = lines[0]
                self._quarantine(path, line.number, line.text, f"the database rejected it: {first_line(exc)}",
                                 result)
                return
            # Split until the lines to blame are found; each half checks again what is stored, in case
            # the failed insert stored part of the batch.
            middle = len(lines) // 2
            self._insert_lines(path, lines[:middle], result)
            self._insert_lines(path, lines[middle:], result)
            return
        result.spans += len(rows)

    def _insert_rows(self, path: Path, rows: list[SpanRow], result: FileResult) -> None:
        """Store ``rows``: request spans with packed arrays through ``kvtrace_request_spans``, the rest
        through ``otel_traces`` and its views."""
        typed = [row for row in rows if row.arrays is not None]
        plain = [row for row in rows if row.arrays is None] if typed else rows
        if plain:
            self.client.insert(TABLE, plain, column_names=COLUMNS)
        if not typed:
            return
        try:
            self.client.insert(TYPED_REQUESTS_TABLE, [request_span_row(row) for row in typed], column_names=TYPED_COLUMNS,
                               settings={"log_comment": TYPED_INGEST_COMMENT})
        except Exception as exc:  # noqa: BLE001 - the spans go the Collector's way instead
            if database_refuses_writes(exc):
                raise IngestStopped(f"the database stopped accepting spans: {first_line(exc)}") from None
            # Whatever part of the insert was stored is completed; the rest goes through the JSON view.
            stored = self._stored_spans(typed)
            self._make_whole(typed, stored)
            rest = [collector_row(row) for row in typed if (row[_TRACE_ID], row[_SPAN_ID]) not in stored]
            if rest:
                self.client.insert(TABLE, rest, column_names=COLUMNS)
            result.messages.append(f"{path}: {len(typed)} request span(s) got their rows through the JSON view: "
                                   f"the insert with packed arrays failed: {first_line(exc)}")

    def _drop_stored(self, path: Path, lines: list[_Line], result: FileResult) -> None:
        """Drop rows whose span is stored already, after making sure its rows in every table are there too."""
        rows = [row for line in lines for row in line.rows]
        stored = self._stored_spans(rows)
        try:
            completed, half_stored = self._make_whole(rows, stored)
        except Exception as exc:  # noqa: BLE001 - same boundary as the insert itself
            if database_refuses_writes(exc):
                raise IngestStopped(f"the database stopped accepting spans: {first_line(exc)}") from None
            result.messages.append(f"{path}: could not complete the rows of {len(stored)} span(s) stored before: "
                                   f"{first_line(exc)}")
            completed = half_stored = 0
        if not stored:
            return
        for line in lines:
            kept = [row for row in line.rows if (row[_TRACE_ID], row[_SPAN_ID]) not in stored]
            result.duplicates += len(line.rows) - len(kept)
            line.rows = kept
        if half_stored:
            result.messages.append(f"{path}: {half_stored} request span(s) an ingest stopped mid-insert had stored in "
                                   "kvtrace_requests alone got their otel_traces rows now")
        if completed:
            result.messages.append(f"{path}: {completed} span(s) stored by an ingest that stopped mid-insert got "
                                   "their view rows now")

    def _make_whole(self, rows: list[SpanRow], stored: set[tuple[str, str]]) -> tuple[int, int]:
        """Complete the spans of ``rows`` stored already: those in ``otel_traces`` (``stored``) get their
        missing view rows; those in ``kvtrace_requests`` alone (an insert into ``kvtrace_request_spans``
        that stopped halfway can leave one) get their ``otel_traces`` row first, and join ``stored``.
        Returns how many spans got view rows, and how many an ``otel_traces`` row."""
        candidates = [row for row in rows if row.arrays is not None and (row[_TRACE_ID], row[_SPAN_ID]) not in stored]
        half = self._stored_spans(candidates, REQUESTS_TABLE) if candidates else set()
        if half:
            # Stored, whatever happens next: inserting them again would store their request rows twice.
            stored |= half
            # Their request rows are there: the JSON view must pass them over, as in the insert that stopped.
            self.client.insert(TABLE, [collector_row(row) for row in candidates
                                       if (row[_TRACE_ID], row[_SPAN_ID]) in half],
                               column_names=COLUMNS, settings={"log_comment": TYPED_INGEST_COMMENT})
        completed = complete_views(self.client, [span_id for _, span_id in stored]) if stored else 0
        return completed, len(half)

    def _stored_spans(self, rows: list[list], table: str = TABLE) -> set[tuple[str, str]]:
        """(TraceId, SpanId) of the spans of ``rows`` that ``table`` holds."""
        candidates = [row for row in rows if row[_SPAN_ID]]
        stored: set[tuple[str, str]] = set()
        for start in range(0, len(candidates), STORED_CHECK_BATCH):
            batch = candidates[start:start + STORED_CHECK_BATCH]
            wanted = {(row[_TRACE_ID], row[_SPAN_ID]) for row in batch}
            try:
                found = self.client.query(STORED_SPANS_SQL, parameters={
                    "table": table,
                    "earliest": min(row[_TIMESTAMP] for row in batch),
                    "latest": max(row[_TIMESTAMP] for row in batch),
                    "span_ids": sorted({ident[1] for ident in wanted}),
                }).result_rows
            except Exception as exc:  # noqa: BLE001 - a database that cannot answer cannot be written either
                raise IngestStopped(f"the database could not say which spans it holds: {first_line(exc)}") from None
            stored.update(ident for ident in found if tuple(ident) in wanted)
        return {tuple(ident) for ident in stored}


def request_span_row(row: SpanRow) -> list:
    """The ``kvtrace_request_spans`` row of a request span: its ``otel_traces`` row and its arrays packed."""
    arrays = row.arrays
    return [*row, *[pack(arrays[key], typecode) if key in arrays else b"" for key, typecode in _PACKED]]


_PACKED = [(key, PACKED_ARRAYS[key]) for key in TOKEN_ARRAYS]


def typed_requests_available(client) -> bool:
    """Whether request spans can go through ``kvtrace_request_spans``: the table and both its views are
    there, the JSON view knows to pass them over (a database whose schema predates this keeps the JSON
    view alone), and no Distributed table is in between (a forwarded insert need not carry its
    ``log_comment`` to the shards)."""
    try:
        found = {name: (engine, select) for name, engine, select in client.query(
            _TYPED_VIEW_SQL, parameters={"typed": TYPED_REQUESTS_TABLE,
                                         "views": list(TYPED_REQUESTS_VIEWS)}).result_rows}
    except Exception:  # noqa: BLE001 - then the view path, which needs nothing of this
        return False
    return (TYPED_REQUESTS_TABLE in found and all(view in found for view in TYPED_REQUESTS_VIEWS)
            and found.get("kvtrace_requests", ("",))[0] != "Distributed"
            and TYPED_INGEST_COMMENT in found.get("kvtrace_requests_mv", ("", ""))[1])


def ingest_paths(client, paths: Iterable[Path], quarantine_dir: Optional[Path] = None,
                 progress: Optional[Callable[[str], None]] = None) -> IngestReport:
    """Ingest every span file under ``paths``.  Requires the schema (``kvtrace db init``).

    Raises ``UnusableInput`` / ``UnreadableInput`` for a path argument that cannot be ingested, and
    ``IngestStopped`` (carrying the report so far as ``.report``) when the database stops accepting
    spans.  A file that cannot be read is reported in its result's messages and passed over.
    """
    report = IngestReport()
    files = find_files(paths, report.passed_over)
    try:
        ingestor = Ingestor(client, quarantine_dir or default_spool_dir() / "quarantine", progress)
        for index, path in enumerate(files, 1):
            ingestor.progress(f"[{index}/{len(files)}] {path.name}")
            report.files.append(FileResult(str(path)))  # before: a stop mid-file still counts its spans
            ingestor.ingest_file(path, report.files[-1])
    except IngestStopped as exc:
        exc.report = report
        raise
    except Exception as exc:  # noqa: BLE001 - the progress log itself could not be read or written
        if not database_refuses_writes(exc):
            raise
        stopped = IngestStopped(f"the database stopped accepting spans: {first_line(exc)}")
        stopped.report = report
        raise stopped from None
    return report


def pending_files(spool_dir: Path, client, problems: Optional[list[str]] = None) -> list[tuple[Path, int]]:
    """Spool files with bytes not yet ingested: (path, pending bytes).  What cannot be read (the directory,
    a file, an entry that is a link or a FIFO) is added to ``problems``; a spool not made yet is empty.

    Judged by size against the furthest checkpoint of each file's first line, without reading more of the
    files (``db status`` must stay cheap); ingest itself checks the content.
    """
    spool_dir = Path(spool_dir)
    problems = [] if problems is None else problems
    passed_over: list[str] = []
    try:
        files = find_files([spool_dir], passed_over)
    except UnusableInput as exc:
        if spool_dir.exists() or spool_dir.is_symlink():
            problems.append(str(exc))
        return []
    except UnreadableInput as exc:
        problems.append(str(exc))
        return []
    for entry in passed_over:
        problems.append(f"{entry}: not read")
    log = IngestLog(client)
    out = []
    for path in files:
        try:
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                head = f.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            problems.append(f"{path}: cannot read it: {exc.strerror or exc}")
            continue
        done = max((c.offset for c in log.checkpoints(_digest(head)) if c.offset <= size), default=0)
        if size > done:
            out.append((path, size - done))
    return out
