"""The in-process engines' backend: a replay's steps in an engine process of its own.

llama-cpp-python runs in ``child``, vLLM's offline ``LLM`` in ``vllm_child``. Watched as an experiment
pass is (``experiment.isolation.run_child``): the model is loaded there with the recorded
configuration, a different one is refused, and a native crash or hang ends the replay with a clear
error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kvtrace.errors import EngineFailed
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT, PassDied, run_child
from kvtrace.progress import Progress
from kvtrace.replay.recorded import EngineConfiguration, ReplayRefused, Step, plan_json

CHILD_MODULE = "kvtrace.replay.child"
VLLM_CHILD_MODULE = "kvtrace.replay.vllm_child"


class EngineProcess:
    """Re-executes steps on ``model`` in a fresh engine process per replay (``child_module``: which engine)."""

    def __init__(self, model: Path, timeout: float = DEFAULT_PASS_TIMEOUT, child_module: str = CHILD_MODULE):
        self.model = model
        self.timeout = timeout
        self.child_module = child_module

    def execute(self, configuration: EngineConfiguration, steps: list[Step],
                progress: Progress) -> dict[str, dict[str, Any]]:
        """Per step key: the generated ids and the prompt tokens reused; ``ReplayRefused`` when the engine
        loaded is not the recorded one."""
        shown = 0

        def advance(text: str, done: int) -> None:
            nonlocal shown
            progress.advance(done - shown)
            shown = done
            progress(text)

        progress.start(len(steps), "requests")
        with tempfile.NamedTemporaryFile("w", prefix="kvtrace-replay-", suffix=".json") as plan:
            plan.write(plan_json(str(self.model), configuration, steps))  # a file: prompts outgrow a command line
            plan.flush()
            try:
                result = run_child(self.child_module, plan.name, self.timeout, advance)
            except PassDied as died:
                raise EngineFailed(f"the replay's engine {died.cause} after {died.requests} request(s)") from None
            finally:
                progress.close()
        if result.get("interrupted"):
            raise KeyboardInterrupt
        if result.get("refused"):
            raise ReplayRefused(result["refused"])
        return result["outcomes"]
