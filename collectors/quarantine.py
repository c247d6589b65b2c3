"""Where ingest puts the lines it cannot store, and reads them back for ``kvtrace db status``."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Optional

from kvtrace.safe_files import append_private, open_regular, private_dir, regular_entries


class Quarantine:
    """Copies of rejected lines, one JSON record each, in ``<dir>/<file name>.quarantine.jsonl``; a line
    copied before (a pass that re-reads after a stop) is not copied twice.  A copy that cannot be written
    (a full disk) is still reported and counted: the line stays in its own file, which ingest never changes."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._recorded: dict[Path, set[tuple[str, int]]] = {}

    def add(self, source: Path, line_no: int, text: bytes, reason: str) -> str:
        """Copy the line; returns where it went (or why it could not be copied), for the message."""
        target = self.directory / f"{source.name}.quarantine.jsonl"
        try:
            if target not in self._recorded:
                self._recorded[target] = {(r.get("file"), r.get("line")) for r in read_quarantine_file(target)}
            if (str(source), line_no) not in self._recorded[target]:
                private_dir(self.directory, link_ok=False)
                record = {"file": str(source), "line": line_no, "error": reason,
                          "text": bytes(text).decode("utf-8", errors="replace")}
                with os.fdopen(append_private(target), "a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
                self._recorded[target].add((str(source), line_no))
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
    try:
        targets, others = regular_entries(Path(quarantine_dir), (".quarantine.jsonl",), link_ok=False)
    except FileNotFoundError:
        return []
    except OSError as exc:
        problems.append(f"{quarantine_dir}: cannot list it: {exc.strerror or exc}")
        return []
    problems.extend(f"{entry} ({what}): not read" for entry, what in others)
    return [{"file": str(r.get("file", "")), "line": r.get("line"), "error": str(r.get("error", ""))}
            for target in targets for r in read_quarantine_file(target)]
