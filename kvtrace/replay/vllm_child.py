"""The vLLM replay's engine process: ``python -m kvtrace.replay.vllm_child FD PLAN_FILE``.

The twin of ``child`` for vLLM's offline ``LLM`` (``vllm_engine``), watched by the parent the same
way: a progress line before every request, then its result: ``refused`` (the engine started here is
not the recorded one) or ``outcomes`` (per step: generated ids and cached prompt tokens).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from kvtrace.replay.recorded import EngineConfiguration
from kvtrace.replay.vllm_engine import configuration_of, execute, load_engine, max_model_len, refusal


def main(argv: Optional[list[str]] = None) -> int:
    fd, plan_file = sys.argv[1:] if argv is None else argv
    report = os.fdopen(int(fd), "w", buffering=1)
    plan = json.loads(Path(plan_file).read_text())
    steps = plan["steps"]
    recorded = EngineConfiguration(**plan["configuration"])

    def progress(done: int, step: dict) -> None:
        report.write(json.dumps({"progress": f"request {done + 1}/{len(steps)}", "requests": done,
                                 "turns": done}) + "\n")

    llm = load_engine(Path(plan["model"]), recorded, max_model_len(steps))
    why = refusal(recorded, configuration_of(llm, recorded))
    if why:
        result = {"requests": 0, "refused": why}
    else:
        try:
            result = {"requests": len(steps), "outcomes": execute(llm, steps, progress)}
        except KeyboardInterrupt:
            result = {"requests": 0, "interrupted": True}
    report.write(json.dumps({"result": result}) + "\n")
    report.close()
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from replaying again
    sys.exit(main())
