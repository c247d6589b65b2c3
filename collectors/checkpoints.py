"""Ingest's progress in ``kvtrace_ingest_files``: per file, the bytes stored so far, keyed by the hash of
the file's first line and of the bytes before the checkpoint (so a copy or a concatenation resumes where
its own bytes match, docs/storage.md)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

LOG_TABLE = "kvtrace_ingest_files"
LOG_COLUMNS = ["file_key", "path", "offset", "lines", "spans", "quarantined", "complete", "updated"]


def key_of(hasher) -> str:
    """The key a SHA-256 of some bytes gives: what checkpoints and stored lines are keyed by."""
    return hasher.hexdigest()[:32]


def digest(data: bytes) -> str:
    return key_of(hashlib.sha256(data))


@dataclass(frozen=True)
class Checkpoint:
    """One row of ``kvtrace_ingest_files``: a file's bytes [0, offset) are stored, with running totals.
    ``prefix`` hashes those bytes (rows of older versions have none: trusted by their first line alone)."""

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


class IngestLog:
    """Checkpoints in ``kvtrace_ingest_files``, grouped by the hash of each file's first line."""

    def __init__(self, client):
        self.client = client
        self._by_head: dict[str, dict[str, Checkpoint]] = {}
        for key, *numbers in client.query(
                f"SELECT file_key, offset, complete, lines, spans, quarantined FROM {LOG_TABLE} FINAL").result_rows:
            head, _, prefix = str(key).partition(":")
            self._remember(Checkpoint(head, prefix, int(numbers[0]), bool(numbers[1]), *map(int, numbers[2:])))

    def _remember(self, checkpoint: Checkpoint) -> None:
        self._by_head.setdefault(checkpoint.head, {})[checkpoint.key] = checkpoint

    def checkpoints(self, head: str) -> list[Checkpoint]:
        """This first line's checkpoints, furthest first."""
        return sorted(self._by_head.get(head, {}).values(), key=lambda c: -c.offset)

    def save(self, checkpoint: Checkpoint, path: Path) -> None:
        c = checkpoint
        self.client.insert(LOG_TABLE, [[c.key, str(path), c.offset, c.lines, c.spans, c.quarantined, int(c.complete),
                                        time.time_ns() // 1000]], column_names=LOG_COLUMNS)
        self._remember(checkpoint)
