"""The replay's engine process: ``python -m kvtrace.replay.child FD PLAN_FILE``.

Watched by the parent as an experiment pass is (``experiment.isolation.run_child``): a native crash
or hang ends the replay with a clear error, Ctrl-C stops it between requests. It writes a progress
line before every request, then its result: ``refused`` (the engine loaded here is not the recorded
one) or ``outcomes`` (per step: generated ids and reused prompt tokens).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from kvtrace.replay.engine import configuration_of, execute, load_engine, refusal
from kvtrace.replay.recorded import EngineConfiguration


def main(argv: Optional[list[str]] = None) -> int:
    fd, plan_file = sys.argv[1:] if argv is None else argv
    report = os.fdopen(int(fd), "w", buffering=1)
    plan = json.loads(Path(plan_file).read_text())
    steps = plan["steps"]
    model = Path(plan["model"])
    recorded = EngineConfiguration(**plan["configuration"])

    def progress(done: int, step: dict) -> None:
        report.write(json.dumps({"progress": f"request {done + 1}/{len(steps)}", "requests": done,
                                 "turns": done}) + "\n")

    llm = load_engine(model, recorded.numerics)
    try:
        why = refusal(recorded, configuration_of(llm, model))
        if why:
            result = {"requests": 0, "refused": why}
        else:
            try:
                result = {"requests": len(steps), "outcomes": execute(llm, steps, progress)}
            except KeyboardInterrupt:
                result = {"requests": 0, "interrupted": True}
    finally:
        llm.close()
    report.write(json.dumps({"result": result}) + "\n")
    report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
