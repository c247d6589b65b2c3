"""Each engine pass of `kvtrace experiment` runs in its own process. When llama.cpp dies by a signal
or hangs in one pass, the command stops there and exits 1 with one line that names the pass, the
signal or the time-out and what to try next; the passes before it stay recorded and queryable.
Ctrl-C still stops cleanly with exit 130.

The engine is broken on purpose the way a user's would break: a `sitecustomize` on PYTHONPATH makes
`Llama.create_completion` of one named run kill its own process with SIGSEGV, or sleep forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from kvtrace import queries  # noqa: E402
from kvtrace.db import connect  # noqa: E402

BREAKER = textwrap.dedent("""
    import os

    _run = os.environ.get("BREAK_RUN")
    if _run:
        import signal
        import time

        import llama_cpp
        from opentelemetry import baggage

        from kvtrace import semconv

        _complete = llama_cpp.Llama.create_completion

        def create_completion(self, *args, **kwargs):
            if baggage.get_baggage(semconv.RUN_ID) == _run:
                if os.environ["BREAK_HOW"] == "segfault":
                    os.kill(os.getpid(), signal.SIGSEGV)
                open(os.environ["BREAK_MARK"], "w").close()
                while True:  # a decode that never returns
                    time.sleep(60)
            return _complete(self, *args, **kwargs)

        llama_cpp.Llama.create_completion = create_completion
""")

EPISODES, TURNS = 3, 2
SETTINGS = "b256.ub256.fa-off.kv-f16"  # the engine settings' part of a run id, at their defaults
FIRST_PASS, SECOND_PASS = f"story/F32/{SETTINGS}/off/r0/canonical", f"story/F32/{SETTINGS}/reuse/r0/canonical"


@pytest.fixture
def experiment_with_a_broken_pass(kvtrace_env):
    """Start `kvtrace experiment` (F32 off, then F32 reuse) whose run ``run_id`` breaks as ``how``."""
    hooks = kvtrace_env / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(BREAKER)
    mark = kvtrace_env / "engine-stuck"

    def start(run_id: str, how: str, *options: str) -> tuple[subprocess.Popen, object]:
        env = dict(os.environ, PYTHONPATH=str(hooks), BREAK_RUN=run_id, BREAK_HOW=how, BREAK_MARK=str(mark),
                   PYTHONFAULTHANDLER="1")
        argv = [sys.executable, "-m", "kvtrace.cli", "experiment", "--generate", "tiny", "--formats", "F32",
                "--arms", "off,reuse", "--episodes", str(EPISODES), "--turns", str(TURNS), "--tokens", "8",
                "--prefix", "story", *options]
        # Ctrl-C reaches the command even where the tests themselves run with SIGINT ignored (a script's
        # background job): the command is started as a terminal would start it.
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)), mark

    return start


def recorded_runs(kvtrace_env) -> dict[str, int]:
    """Run id → requests, from the saved query `runs` on the command's database (after it exited)."""
    client = connect(f"chdb://{kvtrace_env / 'db'}")
    try:
        columns, rows = queries.run(client, "runs")
    finally:
        client.close()
    return {r["run_id"]: r["requests"] for r in (dict(zip(columns, row)) for row in rows)}


def processes_with(environment_entry: str) -> list[int]:
    """Live processes whose environment holds this entry (the test's own engine processes)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and environment_entry.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("kvtrace: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_an_engine_that_segfaults_in_the_second_pass_ends_the_command_with_a_clear_error(
        experiment_with_a_broken_pass, kvtrace_env):
    command, _ = experiment_with_a_broken_pass(SECOND_PASS, "segfault")
    out, err = command.communicate(timeout=600)

    assert command.returncode == 1, err
    message = error_line(err)
    assert "SIGSEGV" in message and SECOND_PASS in message
    assert "format F32, arm reuse, repeat 0, order canonical" in message
    assert "--formats F32 --arms reuse" in message  # what to try next
    assert "Traceback" not in err and out == ""  # no report for a grid that did not finish
    assert recorded_runs(kvtrace_env) == {FIRST_PASS: EPISODES * TURNS}


def test_an_engine_that_hangs_is_stopped_after_the_pass_timeout(experiment_with_a_broken_pass, kvtrace_env):
    command, mark = experiment_with_a_broken_pass(SECOND_PASS, "hang", "--pass-timeout", "20")
    out, err = command.communicate(timeout=600)

    assert mark.exists(), "the second pass's engine was stuck"
    assert command.returncode == 1, err
    message = error_line(err)
    assert "made no progress for 20 s (--pass-timeout)" in message and SECOND_PASS in message
    assert recorded_runs(kvtrace_env) == {FIRST_PASS: EPISODES * TURNS}
    assert processes_with(f"BREAK_MARK={mark}") == [], "the stuck engine process was killed"


def test_ctrl_c_during_a_pass_stops_cleanly_and_keeps_what_was_recorded(experiment_with_a_broken_pass, kvtrace_env):
    command, mark = experiment_with_a_broken_pass(SECOND_PASS, "hang")
    deadline = time.monotonic() + 600
    while not mark.exists():
        assert command.poll() is None and time.monotonic() < deadline, command.communicate()[1]
        time.sleep(0.2)
    command.send_signal(signal.SIGINT)
    try:
        out, err = command.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
        command.send_signal(signal.SIGABRT)
        raise AssertionError("no exit within 120 s of Ctrl-C; the command's stacks:\n"
                             + command.communicate(timeout=60)[1][-6000:]) from None

    assert command.returncode == 130, err
    assert out.startswith("interrupted: the table covers what was recorded before the stop")
    assert "Traceback" not in err
    # The stuck request itself is recorded too (as failed): the engine process flushed before it exited.
    assert recorded_runs(kvtrace_env) == {FIRST_PASS: EPISODES * TURNS, SECOND_PASS: 1}
