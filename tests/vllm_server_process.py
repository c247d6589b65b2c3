"""vLLM's OpenAI-compatible server for tests: ``kvtrace run -- vllm serve`` on a generated model, as
README.md starts it, and stopped so that every vLLM process flushes its spans."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from kvtrace.experiment.server import wait_until_healthy
from readme_commands import readme_command

VENV_BIN = Path(sys.executable).parent
MODEL_NAME = "tiny"
STARTUP_S = 240
SERVE = "kvtrace run -- vllm serve MODEL --enable-prefix-caching"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def like_a_gpu_environment() -> dict[str, str]:
    """What runs a vLLM server's every process as on a GPU (tests/vllm_cpu_site/sitecustomize.py)."""
    path = [str(Path(__file__).with_name("vllm_cpu_site")), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"KVTRACE_TEST_LIKE_A_GPU": "1", "PYTHONPATH": os.pathsep.join(path)}


def serve_command(model: Path, like_a_gpu: bool = False) -> list[str]:
    """README's ``kvtrace run -- vllm serve MODEL ...``; where vLLM is installed as the ``vllm-cpu``
    distribution its ``vllm`` script exits at start (it asks for the version of a distribution named
    ``vllm``), so the same server is started through the module that ``vllm serve`` runs.
    ``like_a_gpu``: with async scheduling (and :func:`like_a_gpu_environment`)."""
    from importlib.metadata import PackageNotFoundError, version

    argv = readme_command(SERVE, {"MODEL": str(model)}) + (["--async-scheduling"] if like_a_gpu else [])
    at = argv.index("vllm")
    try:
        version("vllm")
        argv[at] = str(VENV_BIN / "vllm")
    except PackageNotFoundError:
        argv[at:at + 3] = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model)]
    return argv


@contextlib.contextmanager
def running_vllm_server(hf_model: Path, spool_dir: Path, log_path: Path, *extra: str,
                        env: Optional[dict[str, str]] = None,
                        like_a_gpu: bool = False) -> Iterator[tuple[str, Callable[[], None]]]:
    """The traced server on a free port, spans to ``spool_dir``; yields its base URL and ``stop()``
    (graceful; also called on exit). ``extra``: more arguments; ``env``: more of its environment;
    ``like_a_gpu``: see :func:`serve_command`."""
    port = free_port()
    # The autouse kvtrace_env fixture has set KVTRACE_SPOOL_DIR / XDG_DATA_HOME / KVTRACE_CAPTURE in os.environ.
    env = dict(os.environ, **(env or {}), **(like_a_gpu_environment() if like_a_gpu else {}),
               VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               KVTRACE_SPOOL_DIR=str(spool_dir), KVTRACE_CAPTURE="ids", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*serve_command(hf_model, like_a_gpu), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--block-size", "32",
             "--enforce-eager", "--seed", "0",
             # vLLM's default (0) aborts: the API process SIGKILLs the engine core right after its SIGTERM,
             # so spans still in the engine core's export batch (up to 1 s old) never reach the spool.
             # Draining lets the engine core exit normally and flush at exit.
             "--shutdown-timeout", "30", *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # graceful: every vLLM process's recorder flushes at exit
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        # Never leave the server or an engine core / worker it spawned behind.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:  # the group is gone: everything exited
            pass
        if process.poll() is None:
            process.wait(timeout=30)

    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(base, process, STARTUP_S):
            stop()
            pytest.fail(f"vllm serve did not become healthy:\n{log_path.read_text(errors='replace')[-4000:]}")
        yield base, stop
    finally:
        stop()


