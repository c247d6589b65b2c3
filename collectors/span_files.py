"""Which files hold spans: the span files a path names, and whether a spool file's writer has ended."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Optional

from kvtrace.errors import UnreadableInput, UnusableInput
from kvtrace.recording.exporters.spool import SPOOL_SUFFIX, spool_host, writer_of
from kvtrace.safe_files import open_regular, regular_entries

SPAN_FILE_SUFFIXES = (SPOOL_SUFFIX, ".json")
PASSED_OVER_NAMED = 5
"""Entries a passed-over message names before it gives the count of the rest."""


def find_files(paths: Iterable[Path], passed_over: Optional[list[str]] = None) -> list[Path]:
    """Span files named by ``paths`` (files as given, through a link too; directories: their regular
    *.jsonl / *.json files, every other entry with such a name added to ``passed_over``).  A path that
    names nothing or no regular file or directory is ``UnusableInput``; one that cannot be read or
    listed ``UnreadableInput``."""
    found: list[Path] = []
    for path in map(Path, paths):
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


def passed_over_message(passed_over: list[str]) -> str:
    """One line for the entries of a span directory that were not read (links, FIFOs, devices)."""
    named = ", ".join(passed_over[:PASSED_OVER_NAMED])
    rest = f" and {len(passed_over) - PASSED_OVER_NAMED} more" if len(passed_over) > PASSED_OVER_NAMED else ""
    return (f"{len(passed_over)} entr{'y' if len(passed_over) == 1 else 'ies'} passed over, never read: "
            f"only regular files are ingested from a directory ({named}{rest})")


def unwatched_because(path: Path) -> Optional[str]:
    """Why kvtrace cannot tell whether anything still writes ``path`` (``None`` when it can: a spool file
    of this host, whose writer's process it can look for)."""
    writer = writer_of(path)
    if writer is None:
        return "it is no kvtrace spool file"
    return None if writer[0] == spool_host() else f"its writer ran on another machine, {writer[0]}"


def writer_is_gone(path: Path) -> bool:
    """True when ``path`` is a kvtrace spool file of this host whose writer process has ended."""
    if unwatched_because(path) is not None:
        return False
    pid = writer_of(path)[1]
    if pid == os.getpid():
        return False  # our own
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        pass
    return False
