"""Where a replay's steps run: one backend per kind of engine, behind one method.

``EngineProcess`` loads the recorded model in an engine process of its own (``engine_process``): a
GGUF file in llama-cpp-python, or a model directory in vLLM's offline ``LLM``; ``ServerBackend`` sends
the steps to a running llama-server (``server``). Each returns, per step key, the generated ids and
the prompt tokens the engine reused, and refuses (``ReplayRefused``) an engine that is not the
recorded one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

from kvtrace.progress import Progress
from kvtrace.replay.recorded import LLAMA_SERVER, VLLM, EngineConfiguration, RecordedRun, ReplayRefused, Step


class Backend(Protocol):
    def execute(self, configuration: EngineConfiguration, steps: list[Step],
                progress: Progress) -> dict[str, dict[str, Any]]:
        """Run ``steps`` in order; per step key ``{"token_ids": [...], "reused": N}``."""


def backend_for(runs: list[RecordedRun], server: Optional[str], model: Optional[Path], progress: Progress,
                timeout: float) -> Backend:
    """The backend that re-executes ``runs``: the server at ``server`` for llama-server runs, else an engine
    process on ``model`` (default: the recorded model found in kvtrace's model cache, or for vLLM the recorded
    model directory)."""
    served = sorted({r.run_id for run in runs for r in run.requests if r.configuration.engine == LLAMA_SERVER})
    if served:
        if server is None:
            raise ReplayRefused(f"run {served[0]!r} was recorded in front of llama-server (kvtrace proxy); give a "
                                f"llama-server serving the recorded model with --server URL")
        from kvtrace.replay.server import ServerBackend

        return ServerBackend(server, timeout)
    on_vllm = any(r.configuration.engine == VLLM for run in runs for r in run.requests)
    if server is not None:
        inside, model_hint = ("vLLM", "DIR") if on_vllm else ("llama-cpp-python", "PATH.gguf")
        raise ReplayRefused(f"run {runs[0].run_id!r} was recorded inside {inside}; --server replays runs recorded "
                            f"in front of llama-server (leave it out, or give --model {model_hint})")
    from kvtrace.replay.engine_process import VLLM_CHILD_MODULE, EngineProcess

    if on_vllm:
        from kvtrace.replay.vllm_model import find_recorded_directory

        return EngineProcess(find_recorded_directory(runs[0], model), timeout, VLLM_CHILD_MODULE)
    from kvtrace.replay.model_lookup import find_recorded_model

    return EngineProcess(model or find_recorded_model(runs[0], progress, timeout), timeout)
