"""What ``kvtrace run`` and ``kvtrace selfcheck`` refuse before an engine starts.

Inside an engine a recorder that cannot be created only costs the traces
(logged once, counted, the engine runs untraced). Before it starts, the same
mistake is cheap to fix, so it is refused with the one-line message of a
:class:`~kvtrace.errors.ConfigError` (exit code 2): every setting parses and
is in range, and the directories the recorder writes to can be written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from kvtrace.config import Settings
from kvtrace.errors import UnwritableDirectory
from kvtrace.safe_files import check_writable_dir


def check_settings(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """The settings an engine started with ``environ`` would use; raises ConfigError if it could not record."""
    settings = Settings.from_env(environ)  # values, ranges, endpoints; creates the hash key if missing
    if not settings.disabled and settings.exporter != "none":
        _check_writable(settings.spool_dir, "KVTRACE_SPOOL_DIR")
    return settings


def _check_writable(directory: Path, variable: str) -> None:
    try:
        check_writable_dir(directory)
    except OSError as exc:
        raise UnwritableDirectory(f"the spool directory {directory} cannot be written ({exc.strerror or exc}); "
                                  f"set {variable} to a directory this user can write") from None
