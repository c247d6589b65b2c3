"""``kvtrace proxy --workers N`` in front of one real llama-server.

The story: one proxy's Python tops out below what a GPU's llama-server streams, so an operator runs two
workers on the one port. Every request is still recorded once and tied to its own task in the server's
log, whichever worker took its connection; a worker that dies is replaced, and what it had spooled stays.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvtrace import semconv as sc
from llama_server_process import free_port, proxy_process, running_llama_server
from readme_commands import PROGRAMS

pytest.importorskip("h11")

REQUESTS = 24


def workers_of(proxy_pid: int) -> list[int]:
    """The worker processes a ``kvtrace proxy --workers`` process started (not multiprocessing's helper)."""
    children = Path(f"/proc/{proxy_pid}/task/{proxy_pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def proxy_pid(port: int) -> int:
    """The pid of the ``kvtrace proxy`` listening (through its workers) on ``port``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"proxy" in argv and f"127.0.0.1:{port}".encode() in argv and b"--workers" in argv:
                return int(entry.name)
    raise AssertionError("no kvtrace proxy process")


def ask(proxy: str, number: int) -> int:
    # A connection of its own per request, so the kernel spreads them over the workers.
    answer = httpx.post(proxy + "/v1/completions", timeout=120, json={
        "prompt": f"Request {number} walks into the {'abcdefghijkl'[number % 12]} hall and", "max_tokens": 6,
        "temperature": 0}, headers={"baggage": f"kvtrace.run_id=workers,kvtrace.episode_id=e{number},kvtrace.turn=0"})
    return answer.status_code


def stored(db) -> dict[str, tuple[str, int]]:
    return {episode: (match, int(task)) for episode, match, task in db.query(
        f"SELECT SpanAttributes['{sc.EPISODE_ID}'], SpanAttributes['{sc.SERVER_TASK_MATCH}'], "
        f"SpanAttributes['{sc.SERVER_TASK_ID}'] FROM otel_traces WHERE SpanAttributes['{sc.RUN_ID}'] = 'workers'"
    ).result_rows}


def test_two_workers_record_every_request_once_each_tied_to_its_own_task(tiny_gguf, tmp_path, spool_dir, db):
    from kvtrace.collectors.ingest import ingest_paths

    port, log = free_port(), tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", log_path=log, slots=2) as server:
        argv = [PROGRAMS["kvtrace"], "proxy", "--upstream", server, "--listen", f"127.0.0.1:{port}",
                "--workers", "2", "--llama-server-log", str(log)]
        with proxy_process(argv, port, tmp_path / "proxy.log") as proxy:
            assert len(workers_of(proxy_pid(port))) == 2
            with ThreadPoolExecutor(6) as pool:
                assert list(pool.map(lambda n: ask(proxy, n), range(REQUESTS))) == [200] * REQUESTS
    # Each worker spooled to a file of its own, and both took connections.
    files = [f for f in spool_dir.iterdir() if f.suffix == ".jsonl"]
    assert len(files) == 2 and all(f.stat().st_size > 0 for f in files)

    ingest_paths(db, [spool_dir])
    spans = stored(db)
    assert sorted(spans) == sorted(f"e{n}" for n in range(REQUESTS))  # every request, once
    assert {match for match, _ in spans.values()} == {sc.TASK_MATCH_MARKER}
    assert len({task for _, task in spans.values()}) == REQUESTS  # no two requests claimed one task


def test_a_worker_that_dies_is_replaced_and_what_it_spooled_stays(tiny_gguf, tmp_path, spool_dir, db):
    from kvtrace.collectors.ingest import ingest_paths

    port, log = free_port(), tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", log_path=log, slots=2) as server:
        argv = [PROGRAMS["kvtrace"], "proxy", "--upstream", server, "--listen", f"127.0.0.1:{port}",
                "--workers", "2", "--llama-server-log", str(log)]
        with proxy_process(argv, port, tmp_path / "proxy.log") as proxy:
            parent = proxy_pid(port)
            first, second = workers_of(parent)
            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(lambda n: ask(proxy, n), range(12))) == [200] * 12
            spooled = {f.name: f.stat().st_size for f in spool_dir.iterdir() if f.suffix == ".jsonl"}
            deadline = time.monotonic() + 30
            while len([s for s in spooled.values() if s]) < 2:  # both workers' spans on disk (batched export)
                assert time.monotonic() < deadline, spooled
                time.sleep(0.2)
                spooled = {f.name: f.stat().st_size for f in spool_dir.iterdir() if f.suffix == ".jsonl"}
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while len(workers_of(parent)) < 2 or first in workers_of(parent):
                assert time.monotonic() < deadline, "the dead worker was not replaced"
                time.sleep(0.1)
            assert second in workers_of(parent)  # the other one served on
            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(lambda n: ask(proxy, n), range(12, 24))) == [200] * 12
    assert "starting another" in (tmp_path / "proxy.log").read_text()
    # The killed worker's file is still there, and the spans it held are stored.
    (killed,) = [f for f in spool_dir.iterdir() if f.suffix == ".jsonl" and f"-{first}-" in f.name]
    ingest_paths(db, [killed])
    before = stored(db)
    assert before and set(before) <= {f"e{n}" for n in range(12)}
    ingest_paths(db, [spool_dir])
    assert {f"e{n}" for n in range(12, 24)} | set(before) <= set(stored(db))  # and every request after the restart
