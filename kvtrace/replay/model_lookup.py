"""The recorded model found in kvtrace's model cache by its fingerprint (``kvtrace replay`` without ``--model``).

Every request records the fingerprint of the model file it ran on, and the experiment keeps the files
it generated or quantized under the model cache (``generated-*.gguf`` at its top, ``BASE-KEY/FORMAT.gguf``
in a folder per base model). A replay looks the fingerprint up among every ``.gguf`` file there: first
in the fingerprints it computed before, kept in the data home per (path, size, mtime), then by reading
the files it has not seen, those with the recorded file name first, in a process of its own
(``fingerprint_child``: llama.cpp reads each file's header and vocabulary, never its weights), which
stops at the first match.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvtrace.config import data_home
from kvtrace.errors import EngineFailed
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT, ChildResult, PassDied, run_child
from kvtrace.experiment.models import model_cache_dir
from kvtrace.replay.recorded import RecordedRun, ReplayRefused

CHILD_MODULE = "kvtrace.replay.fingerprint_child"


@dataclass
class FingerprintResult(ChildResult):
    """What the fingerprinting process reports (``requests``: files read)."""

    fingerprints: dict[str, Optional[str]] = field(default_factory=dict)
    """Path → fingerprint (None: not a model file llama.cpp can read), in the order they were read."""


def fingerprints_file() -> Path:
    return data_home() / "model_fingerprints.json"


def model_files(folder: Path, name: str) -> list[Path]:
    """Every ``.gguf`` file under ``folder``, those named ``name`` first; hidden names (files being
    written: ``make_model``'s temporary folders) left out."""
    found = []
    for root, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        found += [Path(root) / f for f in sorted(files) if f.endswith(".gguf") and not f.startswith(".")]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.name != name)


def find_recorded_model(run: RecordedRun, progress: Callable[[str], None] = lambda m: None,
                        timeout: float = DEFAULT_PASS_TIMEOUT) -> Path:
    """The file in the model cache whose fingerprint ``run`` recorded; ``ReplayRefused`` when none has it."""
    configuration = run.requests[0].configuration
    wanted, name = configuration.model_fingerprint, configuration.model
    if not wanted:
        raise ReplayRefused(f"run {run.run_id!r} recorded no model fingerprint for {name or 'its model'!r}; "
                            f"give the file with --model PATH.gguf")
    folder = model_cache_dir()
    found, looked_at = find_model(wanted, name, folder, progress, timeout)
    if found is None:
        raise ReplayRefused(f"run {run.run_id!r} recorded the model {name or '(unnamed)'!r} with fingerprint "
                            f"{wanted}, which no .gguf file in kvtrace's model cache has ({folder}: {looked_at} "
                            f"looked at); give the file with --model PATH.gguf")
    return found


def find_model(wanted: str, name: str, folder: Path, progress: Callable[[str], None] = lambda m: None,
               timeout: float = DEFAULT_PASS_TIMEOUT) -> tuple[Optional[Path], int]:
    """The ``.gguf`` file under ``folder`` with fingerprint ``wanted`` (None: no file has it), and how many
    files there are; ``name`` (the recorded file name) says which to read first."""
    candidates = model_files(folder, name)
    known = FingerprintCache(fingerprints_file())
    for path in candidates:
        if known.get(path) == wanted:
            return path, len(candidates)
    unread = [p for p in candidates if not known.has(p)]
    if not unread:
        return None, len(candidates)
    computed = _read_fingerprints(unread, wanted, folder, progress, timeout)
    for path in unread:
        if str(path) in computed:
            known.put(path, computed[str(path)])
    known.save(candidates)
    return next((p for p in unread if computed.get(str(p)) == wanted), None), len(candidates)


def _read_fingerprints(paths: list[Path], wanted: str, folder: Path, progress: Callable[[str], None],
                       timeout: float) -> dict[str, Optional[str]]:
    progress(f"looking for the recorded model among {len(paths)} file(s) in {folder}")
    argument = json.dumps({"paths": [str(p) for p in paths], "wanted": wanted})
    try:
        result = FingerprintResult(**run_child(CHILD_MODULE, argument, timeout, lambda text, done: progress(text)))
    except PassDied as died:
        raise EngineFailed(f"reading the fingerprints of the files in {folder}: the process {died.cause}; give "
                           f"the model file with --model PATH.gguf") from None
    finally:
        progress("")
    if result.interrupted:
        raise KeyboardInterrupt
    return result.fingerprints


class FingerprintCache:
    """Fingerprints computed before, each valid while its file keeps the size and mtime it had then."""

    def __init__(self, path: Path):
        self.path = path
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
            self.entries = {k: v for k, v in entries.items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError):  # none yet, or cut short by a full disk: read again
            self.entries = {}

    def has(self, path: Path) -> bool:
        entry, identity = self.entries.get(str(path)), _identity(path)
        return entry is not None and identity is not None and [entry.get("size"), entry.get("mtime_ns")] == identity

    def get(self, path: Path) -> Optional[str]:
        return self.entries[str(path)].get("fingerprint") if self.has(path) else None

    def put(self, path: Path, fingerprint: Optional[str]) -> None:
        identity = _identity(path)
        if identity is not None:
            self.entries[str(path)] = {"size": identity[0], "mtime_ns": identity[1], "fingerprint": fingerprint}

    def save(self, present: list[Path]) -> None:
        """Keep the entries of ``present`` files (the others are gone); a cache that cannot be written
        costs only a second reading next time."""
        kept = {str(p): self.entries[str(p)] for p in present if str(p) in self.entries}
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(kept, indent=1), encoding="utf-8")
            os.replace(tmp, self.path)  # whole or not at all: two replays at once lose nothing but time
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _identity(path: Path) -> Optional[list[int]]:
    try:
        stat = path.stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]
