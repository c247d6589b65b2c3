"""A real llama-server (llama.cpp's own C++ server) for tests, and kvtrace's proxy in front of it.

The binary is the one ``python -m kvtrace.llama_server.build`` builds and caches (.ci/run
does it before the tests); a test that finds none skips, which fails under CI.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
from pathlib import Path
from typing import Iterator, Optional

import pytest

from kvtrace.experiment.server import stop_server, wait_until_healthy

SIZING = ("-c", "1024", "-t", "1", "-tb", "1", "-b", "64", "-ub", "64", "--no-warmup")
"""A small context on one thread: the tiny model on a shared machine."""
SERVER_ARGS = (*SIZING,
               # The CPU repack of quantized weights (AMX) crashes decode on some Xeons; off here, as in
               # kvtrace's own llama.cpp loads, so every machine runs the same kernels.
               "--no-repack")


PER_CALL_BYTES = re.compile(rb'"(id|created)":("[^"]*"|\d+)|"timings":\{[^{}]*\}')


def same_bytes(raw: bytes) -> bytes:
    """The server's own bytes with the per-call values blanked (not re-encoded: every other byte counts)."""
    return PER_CALL_BYTES.sub(rb'"\1":_', raw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_binary() -> Path:
    from kvtrace.llama_server.build import cached_llama_server

    binary = cached_llama_server()
    if binary is None:
        pytest.skip("llama-server is not built; run `python -m kvtrace.llama_server.build` (.ci/run does)")
    return binary


@contextlib.contextmanager
def running_llama_server(model: Path, *extra: str, log_path: Path, slots: int = 1) -> Iterator[str]:
    """Start llama-server on a free port; yields its base URL (``http://127.0.0.1:PORT``)."""
    binary = llama_server_binary()
    port = free_port()
    with started_llama_server([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                               "-np", str(slots), *SERVER_ARGS, *extra], port, log_path) as base:
        yield base


@contextlib.contextmanager
def started_llama_server(argv: list[str], port: int, log_path: Path) -> Iterator[str]:
    """Run a llama-server command line that listens on ``port``, its output in ``log_path``; yields its base URL."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(base, process, 120):
            pytest.fail(f"llama-server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        yield base
    finally:
        stop_server(process)


@contextlib.contextmanager
def proxy_process(argv: list[str], port: int, log_path: Path) -> Iterator[str]:
    """``kvtrace proxy`` as its own process (``argv`` listening on ``port``), output in ``log_path``; yields
    its base URL once it answers. Stopped with SIGINT, a normal stop, which must exit 0."""
    import signal

    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(base, process, 60):  # the upstream's /health, through the proxy
            pytest.fail(log_path.read_text())
        yield base
    finally:
        process.send_signal(signal.SIGINT)  # the spans of requests still being recorded are flushed
        code = process.wait(timeout=120)
    assert code == 0, log_path.read_text()


def running_proxy(upstream: str, recorder=None, llama_server_log: Optional[Path] = None):
    """kvtrace's proxy in this process (its own event loop in a thread); a context giving its base URL.

    ``recorder``: the recorder to use (default: the process recorder, as `kvtrace proxy` does).
    """
    from kvtrace.proxy.app import proxy_in_thread

    return proxy_in_thread(upstream, recorder, llama_server_log)


def sse_payloads(raw: bytes) -> list[Optional[dict]]:
    """The data documents of a server-sent event stream, in order (``None`` for ``[DONE]``)."""
    import json

    out: list[Optional[dict]] = []
    for event in raw.decode("utf-8").split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                out.append(None if payload == "[DONE]" else json.loads(payload))
    return out
