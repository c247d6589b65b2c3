"""Counterfactual verdicts kept where ``kvtrace diff`` finds them.

A verdict belongs to one fork: the pair of request spans (A's and B's) at the forking turn and the
token position. Span ids are unique, so a file in the data home can keep verdicts for every
database without mixing them up; ``diff`` shows a verdict next to the attribution label when it
has one for the fork it prints. The file is append-only JSON lines (the last verdict for a fork
wins), so two replays writing at once lose nothing. It is its user's alone (0600, never written or
read through a symbolic link: ``kvtrace/safe_files.py``).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from kvtrace.analysis.forks import Fork
from kvtrace.config import data_home
from kvtrace.safe_files import append_private, open_regular, private_dir

if TYPE_CHECKING:  # only a type here; reproduce loads the engine side, which `kvtrace diff` does not need
    from kvtrace.replay.reproduce import Counterfactual


def verdicts_file() -> Path:
    return data_home() / "counterfactual_verdicts.jsonl"


def keep(verdict: Counterfactual, path: Optional[Path] = None) -> None:
    path = path or verdicts_file()
    private_dir(path.parent)
    with os.fdopen(append_private(path), "a", encoding="utf-8") as out:
        out.write(json.dumps(verdict.to_json()) + "\n")


def attach(forks: Iterable[Fork], path: Optional[Path] = None) -> None:
    """Set ``verdict`` / ``verdict_note`` on every fork a replay has judged."""
    path = path or verdicts_file()
    try:
        opened = open_regular(path)
    except OSError:  # none kept yet (or a link or FIFO where the file belongs: never read)
        return
    known: dict[tuple[str, str, int], dict] = {}
    with io.TextIOWrapper(opened, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                found = json.loads(line)
                known[(found["span_a"], found["span_b"], int(found["position"]))] = found
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a full disk: the others still count
    for fork in forks:
        found = known.get((fork.a.span_id, fork.b.span_id, fork.position))
        if found:
            fork.verdict, fork.verdict_note = found["verdict"], found["explanation"]
