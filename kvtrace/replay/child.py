"""The replay's engine process for llama-cpp-python: ``python -m kvtrace.replay.child FD PLAN_FILE``.

Watched by the parent as an experiment pass is (``experiment.isolation.run_child``): a native crash
or hang ends the replay with a clear error, Ctrl-C stops it between requests. What it tells the
parent: ``plan_child.serve_plan``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from kvtrace.replay.engine import configuration_of, execute, load_engine, refusal
from kvtrace.replay.plan_child import serve_plan


def main(argv: Optional[list[str]] = None) -> int:
    return serve_plan(argv, lambda plan, recorded: load_engine(Path(plan["model"]), recorded.numerics),
                      lambda llm, plan, recorded: refusal(recorded, configuration_of(llm, Path(plan["model"]))),
                      execute, lambda llm: llm.close())


if __name__ == "__main__":
    sys.exit(main())
