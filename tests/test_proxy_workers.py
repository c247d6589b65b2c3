"""``kvtrace proxy --workers N`` in front of one real llama-server.

The story: one proxy's Python tops out below what a GPU's llama-server streams, so an operator runs two
workers on the one port. Every request is still recorded once and tied to its own task in the server's
log, whichever worker took its connection; a worker that dies is replaced, and what it had spooled stays.

The kernel hashes each connection to one worker's listening socket, so a fixed number of requests may all
land on one worker: the tests ask until each worker has spooled an answer, a bounded number of rounds.
"""

from __future__ import annotations

import json
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
ROUND = 4
ROUNDS = 10
"""Rounds of ``ROUND`` connections until every worker served one: all 40 on one of two workers is a 2**-39
chance."""
SPOOL_WAIT_S = 60
"""How long answered requests' spans may take to reach the spool (batched export, a loaded machine)."""


def workers_of(proxy_pid: int) -> list[int]:
    """The worker processes a ``kvtrace proxy --workers`` process started (not multiprocessing's helper)."""
    children = Path(f"/proc/{proxy_pid}/task/{proxy_pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def proxy_pid(port: int) -> int:
    """The pid of the ``kvtrace proxy`` listening (itself, or through its workers) on ``port``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"proxy" in argv and f"127.0.0.1:{port}".encode() in argv:
                return int(entry.name)
    raise AssertionError("no kvtrace proxy process")


def ask(proxy: str, number: int) -> int:
    # A connection of its own per request, so the kernel spreads them over the workers.
    answer = httpx.post(proxy + "/v1/completions", timeout=120, json={
        "prompt": f"Request {number} walks into the {'abcdefghijkl'[number % 12]} hall and", "max_tokens": 6,
        "temperature": 0}, headers={"baggage": f"kvtrace.run_id=workers,kvtrace.episode_id=e{number},kvtrace.turn=0"})
    return answer.status_code


def listening(proxy_log: Path) -> None:
    """Wait for the proxy's ready line, printed once every worker listens: ``/health`` answers as soon as
    one does, and a connection made before the other listens can only go to the first."""
    deadline = time.monotonic() + 60
    while "kvtrace: proxy on" not in proxy_log.read_text():
        assert time.monotonic() < deadline, proxy_log.read_text()
        time.sleep(0.1)


def spooled_episodes(spool_dir: Path) -> dict[int, set[str]]:
    """The episodes each process (by pid, from its spool files' names) has spooled, whole lines only: a line
    may be half written."""
    from kvtrace.recording.exporters.spool import writer_of

    episodes: dict[int, set[str]] = {}
    for path in spool_dir.glob("*.jsonl"):
        whole = path.read_bytes()
        for line in whole[:whole.rfind(b"\n") + 1].splitlines():
            for resource_spans in json.loads(line)["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        for attribute in span["attributes"]:
                            if attribute["key"] == sc.EPISODE_ID:
                                episode = attribute["value"]["stringValue"]
                                episodes.setdefault(writer_of(path)[1], set()).add(episode)
    return episodes


def ask_and_wait_for_spans(proxy: str, spool_dir: Path, numbers: range, connections: int) -> None:
    """Ask requests ``numbers``, ``connections`` at a time, and wait for their spans in the spool: the
    proxy's stop then has nothing left to flush within its bounded shutdown."""
    with ThreadPoolExecutor(connections) as pool:
        assert list(pool.map(lambda n: ask(proxy, n), numbers)) == [200] * len(numbers)
    deadline = time.monotonic() + SPOOL_WAIT_S
    while not {f"e{n}" for n in numbers} <= set().union(*spooled_episodes(spool_dir).values()):
        assert time.monotonic() < deadline, f"answered but not spooled: {spooled_episodes(spool_dir)}"
        time.sleep(0.2)


def ask_until_each_worker_served(proxy: str, spool_dir: Path, workers: list[int]) -> list[int]:
    """Ask in rounds, waiting after each for its spans in the spool, until every one of ``workers`` has
    spooled an answer; the request numbers asked, from 0."""
    asked: list[int] = []
    for _ in range(ROUNDS):
        numbers = range(len(asked), len(asked) + ROUND)
        ask_and_wait_for_spans(proxy, spool_dir, numbers, ROUND)
        asked += numbers
        if set(workers) <= set(spooled_episodes(spool_dir)):
            return asked
    raise AssertionError(f"{len(asked)} requests and a worker served none: {spooled_episodes(spool_dir)}")


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
            listening(tmp_path / "proxy.log")
            workers = workers_of(proxy_pid(port))
            assert len(workers) == 2
            asked = ask_until_each_worker_served(proxy, spool_dir, workers)
            more = range(len(asked), len(asked) + REQUESTS)  # then many at once, both workers busy
            ask_and_wait_for_spans(proxy, spool_dir, more, 6)
            asked += more
    # Each worker spooled to a file of its own.
    files = [f for f in spool_dir.iterdir() if f.suffix == ".jsonl"]
    assert len(files) == 2 and all(f.stat().st_size > 0 for f in files)

    ingest_paths(db, [spool_dir])
    spans = stored(db)
    assert sorted(spans) == sorted(f"e{n}" for n in asked)  # every request, once
    assert {match for match, _ in spans.values()} == {sc.TASK_MATCH_MARKER}
    assert len({task for _, task in spans.values()}) == len(asked)  # no two requests claimed one task


def cpus_of_threads(pid: int) -> set[frozenset[int]]:
    """The CPU sets a process's threads may run on (one set when every thread has the same)."""
    cpus = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            cpus.add(frozenset(os.sched_getaffinity(int(task))))
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
    return cpus


def test_a_worker_that_dies_is_replaced_and_what_it_spooled_stays(tiny_gguf, tmp_path, spool_dir, db):
    """With --pin-workers: each worker's threads on a CPU of its own, and the replacement on the dead one's."""
    from kvtrace.collectors.ingest import ingest_paths

    allowed = sorted(os.sched_getaffinity(0))
    port, log = free_port(), tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", log_path=log, slots=2) as server:
        argv = [PROGRAMS["kvtrace"], "proxy", "--upstream", server, "--listen", f"127.0.0.1:{port}",
                "--workers", "2", "--llama-server-log", str(log), "--pin-workers"]
        with proxy_process(argv, port, tmp_path / "proxy.log") as proxy:
            listening(tmp_path / "proxy.log")
            parent = proxy_pid(port)
            first, second = workers_of(parent)
            before_kill = ask_until_each_worker_served(proxy, spool_dir, [first, second])
            # After serving, when every thread has started: one CPU set per worker, for all its threads.
            sets = {pid: cpus_of_threads(pid) for pid in (first, second)}
            assert all(len(cpus) == 1 for cpus in sets.values()), sets
            pinned = {pid: sorted(next(iter(cpus))) for pid, cpus in sets.items()}
            assert sorted(pinned.values()) == sorted([[allowed[0]], [allowed[1 % len(allowed)]]])
            assert cpus_of_threads(parent) == {frozenset(allowed)}  # the supervisor is not pinned
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while len(workers_of(parent)) < 2 or first in workers_of(parent):
                assert time.monotonic() < deadline, "the dead worker was not replaced"
                time.sleep(0.1)
            assert second in workers_of(parent)  # the other one served on
            # The replacement pins itself once its interpreter has started.
            while not (replacements := set(workers_of(parent)) - {first, second}) or any(
                    cpus_of_threads(pid) != {frozenset(pinned[first])} for pid in replacements):
                assert time.monotonic() < deadline, f"{replacements} not kept to the dead one's CPU"
                time.sleep(0.1)
            after_kill = range(len(before_kill), len(before_kill) + 12)
            ask_and_wait_for_spans(proxy, spool_dir, after_kill, 4)
    assert "starting another" in (tmp_path / "proxy.log").read_text()
    # The killed worker's file is still there, and the spans it held are stored.
    (killed,) = [f for f in spool_dir.iterdir() if f.suffix == ".jsonl" and f"-{first}-" in f.name]
    ingest_paths(db, [killed])
    before = stored(db)
    assert before and set(before) <= {f"e{n}" for n in before_kill}
    ingest_paths(db, [spool_dir])
    assert {f"e{n}" for n in after_kill} | set(before) <= set(stored(db))  # and every request after the restart


def test_one_pinned_worker_keeps_every_thread_to_the_first_cpu_and_relays(tmp_path):
    from scripted_upstream import ScriptedUpstream, json_answer

    allowed = sorted(os.sched_getaffinity(0))
    port = free_port()
    with ScriptedUpstream(lambda received: json_answer({"status": "ok", "path": received.target})) as upstream:
        argv = [PROGRAMS["kvtrace"], "proxy", "--upstream", upstream.url, "--listen", f"127.0.0.1:{port}",
                "--pin-workers"]
        with proxy_process(argv, port, tmp_path / "proxy.log") as proxy:
            assert httpx.get(proxy + "/v1/models", timeout=30).json() == {"status": "ok", "path": "/v1/models"}
            assert cpus_of_threads(proxy_pid(port)) == {frozenset({allowed[0]})}


def test_pinning_where_the_platform_cannot_is_refused_in_one_line(monkeypatch, capsys):
    from kvtrace.cli import main

    monkeypatch.delattr(os, "sched_setaffinity")  # as on macOS
    assert main(["proxy", "--upstream", "http://127.0.0.1:9", "--pin-workers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pin-workers" in err and "Traceback" not in err
