"""What the example scripts share: running kvtrace's commands as a user types them, and starting
the servers they talk to. Imported from the scripts' own folder, which Python puts first on
sys.path when it runs one of them, whatever the working directory."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from kvtrace.config import data_home

EXAMPLES = Path(__file__).resolve().parent
STARTUP_S = 120


def kvtrace_command() -> list[str]:
    """The ``kvtrace`` command of this interpreter's install. Its console script, not ``python -m``,
    which would put the working directory first on sys.path (a clone's kvtrace/ folder, say)."""
    beside = Path(sys.executable).parent / "kvtrace"
    found = str(beside) if beside.is_file() else shutil.which("kvtrace")
    if found is None:
        raise SystemExit("no kvtrace command found beside this Python or on PATH: pip install kvtrace")
    return [found]


def kvtrace(*args: str, ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    """Run ``kvtrace ARGS...`` with this interpreter's kvtrace, echoing the command line and its output."""
    print(f"\n$ kvtrace {shlex.join(args)}", flush=True)
    done = subprocess.run([*kvtrace_command(), *args], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    sys.stdout.flush()
    if done.returncode not in ok_codes:
        raise SystemExit(f"kvtrace {args[0]} exited with {done.returncode}; see its message above")
    return done


def print_differences(seen: list[dict], run_a: str, run_b: str) -> None:
    """What the caller got back, to set beside kvtrace's account: per episode, the first turn whose
    output differs between the runs (``seen``: one ``{run, episode, turn, output}`` per request)."""
    outputs = {(s["run"], s["episode"], s["turn"]): s["output"] for s in seen}
    differ: dict[str, int] = {}
    for s in sorted(seen, key=lambda s: s["turn"]):
        if s["run"] == run_a and s["output"] != outputs.get((run_b, s["episode"], s["turn"])):
            differ.setdefault(s["episode"], s["turn"])
    if differ:
        print("outputs differ: " + ", ".join(f"{e} from turn {t}" for e, t in sorted(differ.items())), flush=True)
    else:
        print("outputs differ: none (both runs answered every turn alike)", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def started(command: list[str], ready_url: str, log_path: Path, env: Optional[dict[str, str]] = None) -> Iterator[None]:
    """``command`` running until the block ends, once ``ready_url`` answers 200; its output in ``log_path``.

    It runs in the log's folder: a Python server started in a clone of kvtrace would import the clone's
    kvtrace/ folder instead of the install. Stopped with SIGINT, as Ctrl-C would: a traced server
    writes what it still holds to the spool then.
    """
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not answers(ready_url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise SystemExit(f"{command[0]} did not start (its log {log_path}):\n" + "\n".join(tail))
            time.sleep(0.2)
        yield
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def traced_llama_cpp_server(model: Path, flags: list[str], env: dict[str, str], threads: int,
                            log_path: Path) -> Iterator[str]:
    """``kvtrace run -- python -m llama_cpp.server --model MODEL FLAGS...`` on a free port; yields its
    OpenAI base URL. ``env``: kvtrace settings for the server (e.g. ``KVTRACE_CAPTURE``)."""
    port = free_port()
    command = ["kvtrace", "run", "--", sys.executable, "-m", "llama_cpp.server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--verbose", "false", *flags]
    echo(env, command)
    base = f"http://127.0.0.1:{port}/v1"
    with started([*kvtrace_command(), *command[1:]], f"{base}/models", log_path,
                 env={**os.environ, **env}):
        yield base


def echo(env: dict[str, str], command: list[str]) -> None:
    """Print a command line as a user would type it."""
    print("\n$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *command]), flush=True)


def generated_model(name: str) -> Path:
    """A tiny random-weight GGUF made by ``kvtrace make-model`` (once, kept in kvtrace's data folder)."""
    path = data_home() / "models" / f"{name}-tiny-F32.gguf"
    if not path.is_file():
        kvtrace("make-model", "--out", str(path))
    return path


def work_dir(name: str) -> Path:
    """A folder for the servers' logs beside kvtrace's data (``$XDG_DATA_HOME/kvtrace/examples/NAME``)."""
    path = data_home() / "examples" / name
    path.mkdir(parents=True, exist_ok=True)
    return path
