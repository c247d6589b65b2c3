"""Each engine pass in a process of its own, so a native crash or hang ends that pass, not the command.

The parent starts ``python -P -m kvtrace.experiment.pass_process`` (``kvtrace/child_python.py``) with the pass as JSON and reads
its messages from a pipe: a progress line before every request, then the pass's result. The child
inherits the environment (``KVTRACE_*``: spool directory, capture policy), so it records through the
same spool as an in-process run would, and it shuts its recorder down before it sends the result.

A child that dies by a signal, exits without a result, or sends nothing for ``timeout`` seconds
raises ``PassDied``; a stalled child is killed first. Ctrl-C in the parent is passed on to the
child (it runs in its own session, so the terminal's SIGINT reaches only the parent), which stops
between requests and reports what it finished, as an in-process run did.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvtrace.child_python import python_module_command
from kvtrace.experiment.plan import EngineSettings, PassKey, Plan, VllmSettings

CHILD_MODULE = "kvtrace.experiment.pass_process"

DEFAULT_PASS_TIMEOUT = 600.0
"""Seconds without a message before a pass counts as hung: generous, since one message comes per
request and a model load (the slowest step) happens once per pass."""

INTERRUPT_GRACE = 30.0
"""After Ctrl-C: how long the child gets to finish its request and flush what it recorded."""


@dataclass(frozen=True)
class PassSpec:
    """One pass of the grid: everything the child needs to run it."""

    plan: Plan
    model: Path
    key: PassKey
    run_id: str

    def to_json(self) -> str:
        return json.dumps({"plan": asdict(self.plan), "model": str(self.model), "key": asdict(self.key),
                           "run_id": self.run_id})

    @classmethod
    def from_json(cls, text: str) -> "PassSpec":
        data = json.loads(text)
        plan = {k: tuple(v) if isinstance(v, list) else v for k, v in data["plan"].items()}
        settings = VllmSettings if plan.get("engine") == "vllm" else EngineSettings
        key = dict(data["key"], settings=settings(**data["key"]["settings"]))
        return cls(Plan(**plan), Path(data["model"]), PassKey(**key), data["run_id"])


@dataclass
class ChildResult:
    """What every job ``serve_child`` serves reports; each job's result adds its own fields."""

    requests: int = 0
    turns: int = 0
    """Turns done or skipped (an episode whose context is full skips the rest): the progress count."""
    interrupted: bool = False
    peak_rss_bytes: int = 0
    """The engine process's peak resident memory (``ru_maxrss``)."""


@dataclass
class PassResult(ChildResult):
    """What the harness saw during one pass (the spool holds the rest)."""

    restore_checks: int = 0
    restore_mismatches: list[str] = field(default_factory=list)


class PassDied(Exception):
    """The pass's engine process died or stopped making progress; ``cause`` says which."""

    def __init__(self, cause: str, requests: int):
        super().__init__(cause)
        self.cause = cause
        self.requests = requests


def progress_message(text: str, result: ChildResult) -> str:
    return json.dumps({"progress": text, "requests": result.requests, "turns": result.turns})


def result_message(result: ChildResult) -> str:
    return json.dumps({"result": asdict(result)})


def serve_child(argv: list[str], result: ChildResult, job: Callable[[str, Callable[[str], None]], None],
                finish: Callable[[], None] = lambda: None) -> int:
    """The child's side of ``run_child``, for any engine job: ``argv`` is ``FD ARGUMENT``;
    ``job(argument, progress)`` fills ``result`` (a ``ChildResult``) and calls ``progress`` before each
    step. Ctrl-C stops the job and still reports; ``finish`` runs before the result is written (a
    result in the parent's hands means everything the job recorded is flushed). The exit status."""
    fd, argument = argv
    report = os.fdopen(int(fd), "w", buffering=1)

    def progress(text: str) -> None:
        report.write(progress_message(text, result) + "\n")

    try:
        job(argument, progress)
    except KeyboardInterrupt:
        result.interrupted = True
    except BrokenPipeError:
        return 1  # the parent is gone: nobody waits for this job (what it recorded is still flushed)
    finally:
        finish()
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    report.write(result_message(result) + "\n")
    report.close()
    return 0


def run_isolated(spec: PassSpec, timeout: float = DEFAULT_PASS_TIMEOUT,
                 progress: Callable[[str, int], None] = lambda text, turns: None) -> PassResult:
    """Run ``spec`` in a child process and return its result; ``PassDied`` if it crashes or stalls.
    ``progress`` gets each message of the child with the turns it has done so far."""
    return PassResult(**run_child(CHILD_MODULE, spec.to_json(), timeout, progress))


def run_child(module: str, argument: str, timeout: float = DEFAULT_PASS_TIMEOUT,
              progress: Callable[[str, int], None] = lambda text, turns: None) -> dict:
    """Run ``python -m module FD argument`` watched as a pass is (stall clock, Ctrl-C, death by signal)
    and return the ``result`` it wrote to FD, with ``interrupted`` set when Ctrl-C stopped it.
    ``kvtrace replay`` runs its engine this way too."""
    read_fd, write_fd = os.pipe()
    try:
        # stdout goes to our stderr: the command's stdout carries the report (JSON with --format json)
        # and nothing the engine prints may end up inside it.
        child = subprocess.Popen(python_module_command(module, str(write_fd), argument),
                                 pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=2, start_new_session=True)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        return _Watch(child, pipe, timeout, progress).until_done()


class _Watch:
    """Reads one child's messages, keeps the stall clock, and turns how it ended into a result."""

    def __init__(self, child: subprocess.Popen, pipe, timeout: float, progress: Callable[[str, int], None]):
        self.child, self.pipe, self.timeout, self.progress = child, pipe, timeout, progress
        self.requests = 0
        self.pending = b""
        self.result: Optional[dict] = None
        self.interrupted = False
        self.deadline = time.monotonic() + timeout

    def until_done(self) -> dict:
        try:
            self._read_until_closed()
            self._wait_for_exit()
        finally:
            if self.child.poll() is None:
                self._kill()
        return self._verdict()

    def _read_until_closed(self) -> None:
        while True:
            try:
                if not self._read_some():
                    return
            except KeyboardInterrupt:
                self._interrupt()

    def _read_some(self) -> bool:
        """Handle what the child sent next; False once its end is closed (or an interrupted child
        used up its grace period)."""
        # selectors (poll/epoll), not select.select: a host process may hold more than 1024 descriptors.
        with selectors.DefaultSelector() as selector:
            selector.register(self.pipe, selectors.EVENT_READ)
            ready = selector.select(max(0.0, self.deadline - time.monotonic()))
        if not ready:
            if self.interrupted:
                return False  # killed on the way out
            self._kill()
            raise PassDied(f"made no progress for {self.timeout:g} s (--pass-timeout)", self.requests)
        chunk = os.read(self.pipe.fileno(), 1 << 16)
        if not chunk:
            return False  # the child closed its end: it is exiting
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        for line in lines:
            self._handle(json.loads(line))
        return True

    def _handle(self, message: dict) -> None:
        if not self.interrupted:
            self.deadline = time.monotonic() + self.timeout
        if "result" in message:
            self.result = message["result"]
            self.requests = self.result.get("requests", self.requests)
        else:
            self.requests = message["requests"]
            self.progress(message["progress"], message["turns"])

    def _wait_for_exit(self) -> None:
        # Its end of the pipe closes only as it exits, but a native hang in a destructor can still
        # keep it alive: the same stall limit applies.
        try:
            self.child.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if self.interrupted:
                return
            self._kill()
            raise PassDied(f"did not exit within {self.timeout:g} s of finishing its pass (--pass-timeout)",
                           self.requests) from None
        except KeyboardInterrupt:
            self.interrupted = True

    def _interrupt(self) -> None:
        if self.interrupted:  # a second Ctrl-C: stop waiting for it
            self._kill()
            self.deadline = time.monotonic()
            return
        self.interrupted = True
        self.deadline = time.monotonic() + INTERRUPT_GRACE
        try:
            os.kill(self.child.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def _kill(self) -> None:
        try:
            os.killpg(self.child.pid, signal.SIGKILL)  # its own session: any helper it started goes too
        except ProcessLookupError:
            pass
        self.child.wait()

    def _verdict(self) -> dict:
        if self.interrupted:
            return dict(self.result or {"requests": self.requests}, interrupted=True)
        code = self.child.returncode
        if code == 0 and self.result is not None:
            return self.result
        if code is not None and code < 0:
            raise PassDied(f"died with {signal_name(-code)}", self.requests)
        raise PassDied(f"exited with status {code} before finishing (its error is above)", self.requests)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
