"""The divergence protocol against llama-server, through the same request path as `kvtrace proxy`.

``kvtrace experiment --server CMD`` takes llama-server's command line and, for every pass, starts
a fresh server with the arm's configuration, puts kvtrace's proxy in front of it (in this process,
recording to the spool like any engine) and runs the seeded workload through the proxy, serial and
greedy, on llama-server's native ``/completion`` with text prompts. ``--server URL`` uses a server
that is already running instead (the arms it can offer then depend on how it was started).

The arms are what the server offers:

* ``off`` — every request sends ``cache_prompt: false``: the prompt is recomputed;
* ``reuse`` — ``cache_prompt: true`` with the host prompt cache off (``--cache-ram 0``): the one
  slot keeps its state, and each turn reuses the prefix it shares with the turn before;
* ``prompt-cache`` — ``cache_prompt: true`` with the prompt cache on (the server's default size),
  the episodes interleaved turn by turn, so the slot always holds another episode's state and each
  turn is served from the state the server restores from its prompt cache. The server's log
  (``-lv 4``) names, through the proxy, the earlier request whose state came back.

Each pass gets a fresh server, so nothing is cached from another run. The report, forks and
attribution are the in-process experiment's (``report.py``), since the spans are the same.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional
from urllib.parse import urlsplit

import httpx

from kvtrace import semconv as sc
from kvtrace.errors import ConfigError, EngineFailed
from kvtrace.experiment.isolation import PassResult
from kvtrace.experiment.plan import Plan
from kvtrace.experiment.runner import Outcome
from kvtrace.experiment.workload import episode_order, make_episodes
from kvtrace.outside.proxy import proxy_in_thread

SERVER_ARMS = ("off", "reuse", "prompt-cache")
START_TIMEOUT_S = 180.0


def parse_target(text: str) -> tuple[Optional[list[str]], Optional[str]]:
    """``--server``: a running server's URL, or the llama-server command line to start per pass."""
    if text.startswith(("http://", "https://")):
        parts = urlsplit(text)
        if not parts.hostname:
            raise ConfigError(f"--server {text!r}: not an http(s)://host:port URL")
        return None, text.rstrip("/")
    command = shlex.split(text)
    if not command:
        raise ConfigError("--server: give llama-server's command line (or a running server's URL)")
    return command, None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(command: list[str], arm: str, n_ctx: int, workdir: Path) -> Iterator[tuple[str, Path]]:
    """llama-server with the arm's configuration on a free port; yields (base URL, its log file)."""
    port = _free_port()
    log_path = workdir / f"llama-server-{port}.log"
    # Appended last, so they win over the same options in the user's command line.
    arguments = [*command, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", str(n_ctx), "-lv", "4"]
    if arm != "prompt-cache":
        arguments += ["--cache-ram", "0"]
    with open(log_path, "wb") as log:
        try:
            process = subprocess.Popen(arguments, stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            raise ConfigError(f"--server: cannot start {command[0]}: {exc.strerror or exc}") from None
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise EngineFailed(f"llama-server did not start ({' / '.join(tail) or 'no output'}); "
                                   f"its log: {log_path}")
            time.sleep(0.2)
        yield base, log_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def server_weight_format(base: str) -> str:
    """The model's weight format as kvtrace names it, from llama-server's ``/props``."""
    from kvtrace.outside.proxy import llama_server_profile

    try:
        props = httpx.get(f"{base}/props", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        raise EngineFailed(f"{base}/props did not answer: is it llama-server?") from None
    return llama_server_profile(props).weight_format or "unknown"


def run_server_experiment(plan: Plan, command: Optional[list[str]], url: Optional[str],
                          progress: Callable[[str], None] = lambda m: None) -> Outcome:
    """Every pass of ``plan`` (its ``formats`` hold the one format the server's model has)."""
    outcome = Outcome()
    started = time.monotonic()
    total = sum(1 for _ in plan.passes())
    with tempfile.TemporaryDirectory(prefix="kvtrace-server-experiment-") as scratch:
        try:
            for i, (fmt, arm, repeat, order) in enumerate(plan.passes(), 1):
                run_id = plan.run_id(fmt, arm, repeat, order)
                progress(f"[{i}/{total}] {run_id}")
                result = PassResult()
                if command is not None:
                    with started_server(command, arm, plan.n_ctx, Path(scratch)) as (base, log_path):
                        with proxy_in_thread(base, llama_server_log=log_path) as proxy:
                            run_server_pass(plan, base, proxy, run_id, arm, order, result, progress)
                else:
                    with proxy_in_thread(url) as proxy:
                        run_server_pass(plan, url, proxy, run_id, arm, order, result, progress)
                outcome.runs.append({"run_id": run_id, "format": fmt, "arm": arm, "repeat": repeat, "order": order})
                outcome.add(result)
        except KeyboardInterrupt:
            outcome.interrupted = True
        finally:
            from kvtrace.recording.recorder import get_recorder

            recorder = get_recorder()
            if recorder is not None:
                recorder.pipeline.force_flush()
            outcome.seconds = time.monotonic() - started
    return outcome


def run_server_pass(plan: Plan, server: str, proxy: str, run_id: str, arm: str, order: str, result: PassResult,
                    progress: Callable[[str], None]) -> None:
    """One pass: every episode's turns through the proxy; interleaved turn by turn for ``prompt-cache``."""
    episodes = make_episodes(plan.episodes, plan.seed)
    indices = episode_order(plan.episodes, order, plan.seed)
    prompts = {i: episodes[i].opening() for i in indices}
    if arm == "prompt-cache":
        schedule = [(turn, i) for turn in range(plan.turns) for i in indices]
    else:
        schedule = [(turn, i) for i in indices for turn in range(plan.turns)]
    ended: set[int] = set()
    with httpx.Client(timeout=None) as client:
        for n, (turn, index) in enumerate(schedule, 1):
            if index in ended:
                continue
            episode = episodes[index]
            prompt = prompts[index]
            tokens = client.post(f"{server}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
            if len(tokens) + plan.tokens > plan.n_ctx:
                ended.add(index)  # context full: the episode ends here, the same way in every run
                continue
            progress(f"{run_id} request {n}/{len(schedule)}")
            baggage = (f"{sc.RUN_ID}={run_id},{sc.EPISODE_ID}={episode.episode_id},{sc.TURN}={turn},"
                       f"{sc.ARM}={arm}")
            answer = client.post(f"{proxy}/completion", headers={"baggage": baggage}, json={
                "prompt": prompt, "n_predict": plan.tokens, "temperature": 0.0, "seed": plan.seed,
                "cache_prompt": arm != "off"})
            if answer.status_code != 200:
                raise EngineFailed(f"{run_id}: llama-server answered HTTP {answer.status_code}: {answer.text[:200]}")
            text = answer.json()["content"]
            result.requests += 1
            prompts[index] = prompt + text + episode.observe(text, turn)


def check_arms(plan: Plan, url: Optional[str]) -> None:
    unknown = [arm for arm in plan.arms if arm not in SERVER_ARMS]
    if unknown:
        raise ConfigError(f"--server runs the arms {', '.join(SERVER_ARMS)}; not {', '.join(unknown)}")
    if url is not None and "prompt-cache" in plan.arms and "reuse" in plan.arms:
        raise ConfigError("a running server (--server URL) has one prompt-cache setting: give --arms off,reuse or "
                          "off,prompt-cache, or give llama-server's command line to run both configurations")


def detect_format(command: Optional[list[str]], url: Optional[str], n_ctx: int) -> str:
    if url is not None:
        return server_weight_format(url)
    with tempfile.TemporaryDirectory(prefix="kvtrace-server-probe-") as scratch:
        with started_server(command, "off", n_ctx, Path(scratch)) as (base, _):
            return server_weight_format(base)
