"""The model directory a vLLM run recorded, found by its fingerprint (``kvtrace replay`` without ``--model``).

vLLM records the model it was given (a local directory's path, unless a served name replaced it) and
the directory's fingerprint (``patches.vllm.config.model_fingerprint``: its config.json and its weight
files' names, sizes and tails; cheap, so computed here in this process). The recorded path is tried
first, then every model directory in kvtrace's model cache (the experiment's ``generated-hf-*``).
A directory given with ``--model`` must have the recorded fingerprint too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvtrace.experiment.models import model_cache_dir
from kvtrace.patches.vllm.config import model_fingerprint
from kvtrace.replay.recorded import RecordedRun, ReplayRefused


def find_recorded_directory(run: RecordedRun, given: Optional[Path]) -> Path:
    """``given`` when its fingerprint is the recorded one, else the directory that has it; ``ReplayRefused``
    when the recording has none or no directory has it."""
    configuration = run.requests[0].configuration
    wanted, name = configuration.model_fingerprint, configuration.model
    if given is not None:
        found = model_fingerprint(str(given))
        if found is None:
            raise ReplayRefused(f"--model {given}: not a model directory (no config.json); vLLM runs replay on "
                                f"the model directory they were recorded on")
        if wanted and found != wanted:
            raise ReplayRefused(f"--model {given} has fingerprint {found}, but run {run.run_id!r} recorded "
                                f"{name or 'its model'!r} with fingerprint {wanted}: another model, or other "
                                f"weights; give the directory the run was recorded on")
        return given
    if not wanted:
        raise ReplayRefused(f"run {run.run_id!r} recorded no model fingerprint for {name or 'its model'!r} (a hub "
                            f"model name, or a vLLM run recorded before fingerprints); give the model directory "
                            f"with --model DIR")
    candidates = [Path(name)] if name else []
    folder = model_cache_dir()
    if folder.is_dir():
        candidates += sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    for candidate in candidates:
        if model_fingerprint(str(candidate)) == wanted:
            return candidate
    raise ReplayRefused(f"run {run.run_id!r} recorded the model {name or '(unnamed)'!r} with fingerprint {wanted}, "
                        f"which neither that path nor a model directory in kvtrace's model cache ({folder}) has; "
                        f"give the directory with --model DIR")
