"""The vLLM replay's engine process: ``python -m kvtrace.replay.vllm_child FD PLAN_FILE``.

The twin of ``child`` for vLLM's offline ``LLM`` (``vllm_engine``), the same exchange with the parent
(``plan_child.serve_plan``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from kvtrace.replay.plan_child import serve_plan
from kvtrace.replay.vllm_engine import configuration_of, execute, load_engine, max_model_len, refusal


def main(argv: Optional[list[str]] = None) -> int:
    return serve_plan(argv,
                      lambda plan, recorded: load_engine(Path(plan["model"]), recorded, max_model_len(plan["steps"])),
                      lambda llm, plan, recorded: refusal(recorded, configuration_of(llm, recorded)),
                      execute, lambda llm: None)


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from replaying again
    sys.exit(main())
