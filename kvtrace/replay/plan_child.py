"""The exchange between a replay's engine process and its parent (``engine_process``), for every engine:
a progress line before every request, then the result: ``refused`` (the engine started there is not the
recorded one), ``interrupted``, or ``outcomes`` (per step: generated ids and reused prompt tokens).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from kvtrace.replay.recorded import EngineConfiguration

Engine = Any
Progress = Callable[[int, dict], None]


def serve_plan(argv: Optional[list[str]], load: Callable[[dict, EngineConfiguration], Engine],
               refused: Callable[[Engine, dict, EngineConfiguration], Optional[str]],
               run: Callable[[Engine, list, Progress], Any], close: Callable[[Engine], None]) -> int:
    """Read the plan, start the engine (``load``), refuse one that is not the recorded one, run the steps
    and report, one JSON line at a time on the parent's descriptor."""
    fd, plan_file = sys.argv[1:] if argv is None else argv
    report = os.fdopen(int(fd), "w", buffering=1)
    plan = json.loads(Path(plan_file).read_text())
    steps = plan["steps"]
    recorded = EngineConfiguration(**plan["configuration"])

    def progress(done: int, step: dict) -> None:
        report.write(json.dumps({"progress": f"request {done + 1}/{len(steps)}", "requests": done,
                                 "turns": done}) + "\n")

    engine = load(plan, recorded)
    try:
        why = refused(engine, plan, recorded)
        if why:
            result = {"requests": 0, "refused": why}
        else:
            try:
                result = {"requests": len(steps), "outcomes": run(engine, steps, progress)}
            except KeyboardInterrupt:
                result = {"requests": 0, "interrupted": True}
    finally:
        close(engine)
    report.write(json.dumps({"result": result}) + "\n")
    report.close()
    return 0
