"""The divergence protocol against llama-server, through the same request path as `kvtrace proxy`.

``kvtrace experiment --server CMD`` takes llama-server's command line and, for every pass of the
plan, starts a fresh server with the pass's settings, puts kvtrace's proxy in front of it (in this
process, recording to the spool like any engine) and runs the seeded workload through the proxy,
serial and greedy, on llama-server's native ``/completion``: the conversation is kept as text, as an
agent talking to a server does. ``--server URL`` uses a server that is already running instead
(its settings and arms are then whatever it was started with).

The arms are what the server offers:

* ``off`` — every request sends ``cache_prompt: false``: the prompt is recomputed;
* ``reuse`` — ``cache_prompt: true`` with the host prompt cache off (``--cache-ram 0``): the one
  slot keeps its state, and each turn reuses the prefix it shares with what the slot holds;
* ``prompt-cache`` — ``cache_prompt: true`` with the prompt cache holding ``--cache-ram`` bytes
  (whole MiB, llama-server's unit), the episodes always interleaved turn by turn, so the slot holds
  another episode's state and each turn is served from the state the server restores from its
  prompt cache. The server's log (``-lv 4``) names, through the proxy, the request that stored it.

The engine settings of the plan become the server's flags (``-b``, ``-ub``, ``-fa``, ``-ctk``/``-ctv``,
``-t``/``-tb``, ``-c``), appended after the given command line so that they win; the proxy records
them from the server's log, so the report groups the runs as it does in-process. Each pass gets a
fresh server: nothing is cached from another run. The report, forks and attribution are the
in-process experiment's (``report.py``), since the spans are the same.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlsplit

from kvtrace import semconv as sc
from kvtrace.errors import ConfigError, EngineFailed
from kvtrace.experiment.isolation import PassResult
from kvtrace.experiment.plan import PassKey, Plan
from kvtrace.experiment.runner import Outcome
from kvtrace.experiment.workload import episode_order, make_episodes
from kvtrace.http_client import get_json, post_json, request
from kvtrace.progress import Progress
from kvtrace.proxy.app import proxy_in_thread
from kvtrace.proxy.upstream_profile import profile_of_props
from kvtrace.recording.recorder import get_recorder
from kvtrace.testmodels.llama_gguf import QUANTS

SERVER_ARMS = ("off", "reuse", "prompt-cache")
RUNNING_SERVER_ARMS = ("off", "reuse")
"""A running server has one prompt-cache setting: by default it is compared with and without the cache."""
START_TIMEOUT_S = 180.0
MIB = 1 << 20


@dataclass(frozen=True)
class ServerTarget:
    """What ``--server`` names: llama-server's command line (started fresh for every pass) or a
    running server's URL, exactly one of them."""

    command: Optional[tuple[str, ...]] = None
    url: Optional[str] = None

    @property
    def default_arms(self) -> tuple[str, ...]:
        """The arms when none are given: every arm a command line can be started with, or the two a
        running server can offer at once."""
        return SERVER_ARMS if self.command is not None else RUNNING_SERVER_ARMS


def parse_target(text: str) -> ServerTarget:
    """``--server``: a running server's URL, or the llama-server command line to start per pass."""
    if text.startswith(("http://", "https://")):
        if not urlsplit(text).hostname:
            raise ConfigError(f"--server {text!r}: not an http(s)://host:port URL")
        return ServerTarget(url=text.rstrip("/"))
    command = shlex.split(text)
    if not command:
        raise ConfigError("--server: give llama-server's command line (or a running server's URL)")
    return ServerTarget(command=tuple(command))


def run_server(plan: Plan, target: ServerTarget, progress: Progress = Progress()) -> tuple[Plan, Outcome]:
    """``plan`` checked against what the server can run, then every pass of it on the weight format the
    server's model has (asked first); the plan as run, with that one format, and its outcome."""
    check_plan(plan, target.url)
    progress("asking the server for its model's weight format")
    detected = detect_format(target, plan)
    if detected not in QUANTS:
        raise ConfigError(f"the server's model is {detected}; the experiment compares the formats {', '.join(QUANTS)}")
    plan = replace(plan, formats=(detected,))
    return plan, run_server_experiment(plan, target, progress)


def check_plan(plan: Plan, url: Optional[str]) -> None:
    """What a server can run: its three arms, text conversations, cache sizes in whole MiB."""
    unknown = [arm for arm in plan.arms if arm not in SERVER_ARMS]
    if unknown:
        raise ConfigError(f"--server runs the arms {', '.join(SERVER_ARMS)}; not {', '.join(unknown)}")
    if plan.conversation != "text":
        raise ConfigError("--server keeps the conversation as text (--conversation text), as a server's client does")
    if any(size % MIB for size in plan.cache_ram):
        raise ConfigError("--server: llama-server's --cache-ram is in MiB; give whole MiB, e.g. 256MiB or 1GiB")
    if url is not None and "prompt-cache" in plan.arms and "reuse" in plan.arms:
        raise ConfigError("a running server (--server URL) has one prompt-cache setting: give --arms off,reuse or "
                          "off,prompt-cache, or give llama-server's command line to run both configurations")


def server_arguments(plan: Plan, key: PassKey, port: int, log_path: Path) -> list[str]:
    """The pass's settings as llama-server flags (appended last, so they win over the command line's)."""
    s = key.settings
    cache_mib = (key.cache_ram or 0) // MIB if key.arm == "prompt-cache" else 0
    return ["--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", str(plan.n_ctx),
            "-t", str(plan.n_threads), "-tb", str(plan.n_threads), "-b", str(s.n_batch), "-ub", str(s.n_ubatch),
            "-fa", s.flash_attn, "-ctk", s.kv_type, "-ctv", s.kv_type, "--cache-ram", str(cache_mib),
            "-lv", "4", "--log-file", str(log_path)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(command: tuple[str, ...], arguments: list[str], log_path: Path) -> Iterator[str]:
    """llama-server started with ``command + arguments`` (which name its port); yields its base URL."""
    port = arguments[arguments.index("--port") + 1]
    output = log_path.with_suffix(".out")
    with open(output, "wb") as out:
        try:
            process = subprocess.Popen([*command, *arguments], stdout=out, stderr=subprocess.STDOUT)
        except OSError as exc:
            raise ConfigError(f"--server: cannot start {command[0]}: {exc.strerror or exc}") from None
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(base, process, START_TIMEOUT_S):
            said = output.read_text(errors="replace").strip().splitlines()
            said += log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
            raise EngineFailed(f"llama-server did not start ({' / '.join(said[-3:]) or 'no output'}); "
                               f"its log: {log_path}")
        yield base
    finally:
        stop_server(process)


def wait_until_healthy(base: str, process: subprocess.Popen, timeout_s: float, path: str = "/health") -> bool:
    """Poll the server's ``path`` (llama-server's and vLLM's ``/health``) until it answers 200 (True), or
    the process exits or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if request("GET", f"{base}{path}", timeout_s=2).status == 200:
                return True
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> None:
    """Terminate, and kill what does not exit within 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def server_weight_format(base: str) -> str:
    """The model's weight format as kvtrace names it, from llama-server's ``/props``."""
    try:
        profile = profile_of_props(get_json(f"{base}/props", timeout_s=30))
    except (OSError, ValueError, AttributeError, TypeError):
        profile = None
    if profile is None:
        raise EngineFailed(f"{base}/props did not answer: is it llama-server?")
    return profile.weight_format or "unknown"


def detect_format(target: ServerTarget, plan: Plan) -> str:
    """The weight format of the server's model (a command line is started once to ask)."""
    if target.url is not None:
        return server_weight_format(target.url)
    with tempfile.TemporaryDirectory(prefix="kvtrace-server-probe-") as scratch:
        log_path = Path(scratch) / "llama-server.log"
        key = next(plan.passes())
        with started_server(target.command, server_arguments(plan, key, _free_port(), log_path), log_path) as base:
            return server_weight_format(base)


def run_server_experiment(plan: Plan, target: ServerTarget, progress: Progress = Progress()) -> Outcome:
    """Every pass of ``plan`` (whose ``formats`` hold the one format the server's model has)."""
    outcome = Outcome()
    started = time.monotonic()
    keys = list(plan.passes())
    progress.start(len(keys) * plan.episodes * plan.turns, "turns")
    with tempfile.TemporaryDirectory(prefix="kvtrace-server-experiment-") as scratch:
        try:
            for i, key in enumerate(keys, 1):
                run_id = plan.run_id(key)
                result = PassResult()
                if target.command is not None:
                    log_path = Path(scratch) / f"pass-{i}.log"
                    arguments = server_arguments(plan, key, _free_port(), log_path)
                    with started_server(target.command, arguments, log_path) as base:
                        with proxy_in_thread(base, llama_server_log=log_path) as proxy:
                            run_server_pass(plan, base, proxy, key, run_id, result, progress, f"[{i}/{len(keys)}] ")
                else:
                    with proxy_in_thread(target.url) as proxy:
                        run_server_pass(plan, target.url, proxy, key, run_id, result, progress, f"[{i}/{len(keys)}] ")
                outcome.runs.append({"run_id": run_id, "format": key.format, "settings": key.settings.label,
                                     "arm": key.arm, "cache_ram": key.cache_ram, "repeat": key.repeat,
                                     "order": key.order})
                outcome.add(result)
        except KeyboardInterrupt:
            outcome.interrupted = True
        finally:
            recorder = get_recorder()
            if recorder is not None:
                recorder.pipeline.force_flush()
            outcome.seconds = time.monotonic() - started
            progress.close()
    return outcome


def run_server_pass(plan: Plan, server: str, proxy: str, key: PassKey, run_id: str, result: PassResult,
                    progress: Progress, label: str) -> None:
    """One pass: every episode's turns through the proxy; interleaved turn by turn for ``prompt-cache``."""
    episodes = make_episodes(plan.episodes, plan.seed)
    indices = episode_order(plan.episodes, key.order, plan.seed)
    transcripts = {i: episodes[i].opening() for i in indices}
    if key.arm == "prompt-cache" or plan.schedule == "interleaved":
        schedule = [(turn, i) for turn in range(plan.turns) for i in indices]
    else:
        schedule = [(turn, i) for i in indices for turn in range(plan.turns)]
    ended: set[int] = set()
    for turn, index in schedule:
        progress.advance()
        if index in ended:
            continue
        episode = episodes[index]
        prompt = transcripts[index]
        tokens = post_json(f"{server}/tokenize", {"content": prompt, "add_special": True}, timeout_s=None)["tokens"]
        if len(tokens) + plan.tokens > plan.n_ctx:
            ended.add(index)  # context full: the episode ends here, the same way in every run
            continue
        progress(f"{label}{run_id} episode {episode.episode_id} turn {turn + 1}/{plan.turns}")
        baggage = (f"{sc.RUN_ID}={run_id},{sc.EPISODE_ID}={episode.episode_id},{sc.TURN}={turn},"
                   f"{sc.ARM}={key.arm}")
        answer = request("POST", f"{proxy}/completion", headers={"baggage": baggage}, timeout_s=None, json_body={
            "prompt": prompt, "n_predict": plan.tokens, "temperature": 0.0, "seed": plan.seed,
            "cache_prompt": key.arm != "off"})
        if answer.status != 200:
            raise EngineFailed(f"{run_id}: llama-server answered HTTP {answer.status}: {answer.text[:200]}")
        text = answer.json()["content"]
        result.requests += 1
        transcripts[index] = prompt + text + episode.observe(text, turn)
