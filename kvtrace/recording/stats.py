"""Span counters per process, published where ``kvtrace db status`` reads them, even on a full disk.

Every span a process finishes ends in exactly one of: stored (a sink took
it), spooled (written to the spool), or one of the lost counters. Once the
process has shut down::

    spans_finished = spans_stored + spans_spooled + (sum of LOST_COUNTERS)

While it runs, the difference is what is still queued or on its way. In
memory the counters are a ``SpanCounters`` (``counters.py``); what is
published here is one snapshot of them.

Where: ``<spool>/stats/<host>-<pid>-<start_ns>.stats``, or, when the spool
directory cannot take the file (read-only, full), under the data home in
``stats/<key of the spool path>/``. ``read_stats`` looks in both.

How: the file is allocated once, when the process starts recording
(``posix_fallocate``), and every update rewrites those same blocks with
``pwrite``. Rewriting allocated blocks needs no free space, so counters stay
current when the disk fills up later. The file holds two fixed-size slots
written alternately, each a checksummed JSON object with a sequence number;
a reader takes the newest slot whose checksum holds, so it never sees a
half-written update.

The file is created new and private (0600, ``O_EXCL | O_NOFOLLOW``: ``kvtrace/safe_files.py``), and
a reader takes regular files of at most ``FILE_BYTES`` only: anyone who can write to a spool can
leave a link or a FIFO where a counters file belongs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Optional

from kvtrace.config import data_home
from kvtrace.recording.exporters.spool import spool_host
from kvtrace.safe_files import create_private, private_dir, read_bounded, regular_entries

log = logging.getLogger("kvtrace")

COUNTERS = (
    "spans_finished",             # handed to kvtrace's pipeline by the recorder
    "spans_queued",               # accepted into the queue
    "spans_stored",               # taken by the sink (ClickHouse server, Collector)
    "spans_spooled",              # written to the spool (ingest stores them later)
    "spans_spooled_fallback",     # of spans_spooled: spooled because the sink failed or timed out
    "spans_dropped_queue_full",   # lost: the queue was full
    "spans_failed_export",        # lost: neither the sink nor the spool took them
    "spans_dropped_at_shutdown",  # lost: still queued or in a hung sink's hands when the shutdown time was up
    "instrumentation_errors",     # hook failures (the engine's result was returned unchanged)
    "hooks_missing",              # engine names a hook needs that the installed version lacks (a feature is off)
    "rows_misaligned",            # vLLM: a sampler row was not its output token; the request's rows cut there
    "rows_late",                  # vLLM: a request's last rows had not come when it was finished; cut there
    "values_repaired",            # a client's value repaired, its span kept: text UTF-8 cannot carry (lone
                                  # surrogates → U+FFFD), a turn outside Int32 or integer outside int64 (left out)
    "recorder_failures",          # the recorder could not be created: this process ran untraced
    # `kvtrace proxy`: requests and connections it refused (none of them a span), accept failures
    "proxy_bad_requests",         # 400: malformed, not a path (origin form), or with dot-segments
    "proxy_client_timeouts",      # 408: a request's head and body did not arrive in time
    "proxy_refused_body",         # 413: a body over the proxy's limit
    "proxy_refused_headers",      # 431: a head over the proxy's limit
    "proxy_refused_busy",         # 503: as many client connections open as the proxy takes
    "proxy_accept_errors",        # accept() or a connection's thread failed (EMFILE ...): retried
    # `kvtrace proxy --shadow`: cold twins of sampled cache-hit requests (each sent one is a span)
    "shadow_twins_sent",          # sent upstream
    "shadow_twins_dropped",       # sampled, but the budget had no room (in flight, tokens per minute, no idle slot)
    "shadow_twins_unsupported",   # sampled, but the upstream has no cache bypass
    "shadow_twins_state_left",    # sent, but its state stayed in llama-server's slot (llama_server/slots.py)
)
(PROXY_BAD_REQUESTS, PROXY_CLIENT_TIMEOUTS, PROXY_REFUSED_BODY, PROXY_REFUSED_HEADERS, PROXY_REFUSED_BUSY,
 PROXY_ACCEPT_ERRORS) = COUNTERS[-10:-4]
SHADOW_TWINS_SENT, SHADOW_TWINS_DROPPED, SHADOW_TWINS_UNSUPPORTED, SHADOW_TWINS_STATE_LEFT = COUNTERS[-4:]
LOST_COUNTERS = ("spans_dropped_queue_full", "spans_failed_export", "spans_dropped_at_shutdown")

SLOT_BYTES = 2048
FILE_BYTES = 2 * SLOT_BYTES
SUFFIX = ".stats"


def stats_dirs(spool_dir: Path) -> list[Path]:
    """Where counters of processes writing to ``spool_dir`` are published: the spool's own, then the fallback."""
    key = hashlib.sha256(os.path.realpath(spool_dir).encode()).hexdigest()[:16]
    return [Path(spool_dir) / "stats", data_home() / "stats" / key]


def process_tag() -> str:
    return f"{spool_host()}-{os.getpid()}-{time.time_ns()}"


class StatsFile:
    """One process's counters: a preallocated file rewritten in place."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd
        self._seq = 0
        self._lock = threading.Lock()
        self._failing = False

    @classmethod
    def create(cls, spool_dir: Path, tag: Optional[str] = None) -> Optional["StatsFile"]:
        """Allocate this process's file in the first place that takes it; ``None`` (logged) if none does."""
        tag = tag or process_tag()
        reasons = []
        for directory in stats_dirs(spool_dir):
            path = directory / f"{tag}{SUFFIX}"
            fd = -1
            try:
                private_dir(directory, link_ok=False)  # not a link someone left in a shared spool
                fd = create_private(path, os.O_RDWR)
                _allocate(fd)
                stats = cls(path, fd)
                if stats.publish({}):
                    return stats
                raise OSError("first write failed")
            except OSError as exc:
                reasons.append(f"{directory}: {exc.strerror or exc}")
                if fd >= 0:
                    os.close(fd)
                    try:
                        path.unlink()
                    except OSError:
                        pass
        log.warning("kvtrace: span counters cannot be published (%s); they are logged at exit instead",
                    "; ".join(reasons))
        return None

    def publish(self, counters: dict, **details) -> bool:
        """Write ``counters`` (and ``details``, e.g. an error text) over the older slot; never raises."""
        with self._lock:
            try:
                self._seq += 1
                record = {"seq": self._seq, "pid": os.getpid(), "updated_unix": round(time.time(), 3),
                          **{k: int(v) for k, v in counters.items()}, **details}
                body = json.dumps(record, separators=(",", ":")).encode()
                slot = f"{zlib.crc32(body):08x} ".encode() + body
                if len(slot) > SLOT_BYTES - 1:
                    raise ValueError(f"counters need {len(slot)} bytes, a slot holds {SLOT_BYTES - 1}")
                os.pwrite(self._fd, slot.ljust(SLOT_BYTES - 1) + b"\n", (self._seq % 2) * SLOT_BYTES)
            except (OSError, ValueError, TypeError) as exc:
                if not self._failing:
                    log.warning("kvtrace: cannot update span counters in %s (%s)", self.path,
                                getattr(exc, "strerror", None) or exc)
                self._failing = True
                return False
            self._failing = False
            return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = -1


def _allocate(fd: int) -> None:
    """Reserve the blocks every later update rewrites (so a full disk cannot refuse those updates)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, FILE_BYTES)
    else:  # no posix_fallocate (macOS): written blocks are allocated blocks
        os.pwrite(fd, b" " * FILE_BYTES, 0)


def _newest_slot(data: bytes) -> Optional[dict]:
    best = None
    for start in range(0, len(data) - SLOT_BYTES + 1, SLOT_BYTES):
        checksum, _, body = data[start:start + SLOT_BYTES].strip().partition(b" ")
        try:
            if int(checksum, 16) != zlib.crc32(body):
                continue
            record = json.loads(body)
        except ValueError:
            continue
        if isinstance(record, dict) and (best is None or record.get("seq", 0) > best.get("seq", 0)):
            best = record
    return best


def read_stats(spool_dir: Path, problems: Optional[list[str]] = None) -> list[dict]:
    """Latest counters of every process that wrote to ``spool_dir`` (only whole-number counters are kept).

    What cannot be read (a directory, a file, a link, FIFO or oversized file where a counters file
    belongs) is added to ``problems`` and passed over.
    """
    problems = [] if problems is None else problems
    out = []
    for directory in stats_dirs(spool_dir):
        try:
            paths, others = regular_entries(directory, (SUFFIX,), link_ok=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{directory}: cannot list it: {exc.strerror or exc}")
            continue
        for path, what in others:
            problems.append(f"{path} ({what}): not read")
        for path in paths:
            try:
                record = _newest_slot(read_bounded(path, FILE_BYTES))
            except OSError as exc:
                problems.append(f"{path}: cannot read it: {exc.strerror or exc}")
                continue
            if record is None:
                continue
            entry = {"process": path.stem, "stats_file": str(path)}
            for key, value in record.items():
                if key in COUNTERS:
                    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                        entry[key] = value
                elif key in ("pid", "updated_unix", "error"):
                    entry[key] = value
            out.append(entry)
    return out


def span_totals(stats: list[dict]) -> dict[str, int]:
    """Every counter summed over processes (what ``kvtrace db status`` shows)."""
    return {name: sum(int(s.get(name, 0)) for s in stats) for name in COUNTERS}


def lost(totals: dict[str, int]) -> int:
    return sum(totals.get(name, 0) for name in LOST_COUNTERS)
