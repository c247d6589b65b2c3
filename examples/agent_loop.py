"""An agent loop on the official ``openai`` client against a traced server, run twice, then
``kvtrace db ingest``, ``kvtrace runs`` and ``kvtrace diff RUN_A RUN_B``: where the runs forked, or
that they did not.

    python examples/agent_loop.py [--model M.gguf] [--server llama-cpp-python|llama-server]
                                  [--episodes 3] [--turns 3] [--max-tokens 8] [--run-prefix agent-example]
    python examples/agent_loop.py --url http://127.0.0.1:8000/v1     # a server you started yourself

Every request carries W3C baggage naming its run, episode, turn and arm (``kvtrace.correlate`` puts
them in the OpenTelemetry context, the propagator writes the header), so the traced server files
each turn where it belongs. The episodes are interleaved turn by turn, as agents sharing a server
are: a turn finds another episode's state in the context.

Without ``--url`` the script starts the server twice, once per run:

* ``llama-cpp-python``: ``kvtrace run -- python -m llama_cpp.server --model M --cache true`` (run
  ``PREFIX/prompt-cache``: a turn is restored from the state its episode's previous turn stored),
  then ``--cache false`` (run ``PREFIX/reuse``: only the prefix the context still shares is reused);
* ``llama-server``: llama.cpp's own server behind ``kvtrace proxy``, with ``--cache-ram 64`` then
  ``--cache-ram 0`` (the proxy reads the server's log for its prompt-cache decisions).

With ``--url`` both runs go to that server (runs ``PREFIX/first`` and ``PREFIX/second``). Without
``--model`` a tiny random-weight model is generated with ``kvtrace make-model`` (once, kept in
kvtrace's data folder), and token ids are captured in the clear, so the diff shows its tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

import openai
from opentelemetry import propagate

from kvtrace import correlate
from kvtrace.commands.arguments import count, http_url, input_file
from kvtrace.llama_server.build import cached_llama_server

from common import (echo, free_port, generated_model, kvtrace, kvtrace_command, print_differences, started,
                    traced_llama_cpp_server, work_dir)

SYSTEM = "You are a coding agent with a shell tool. Answer with the next command to run."
TASK = "Task {e}: the test suite of project {e} fails on import; find out why and fix it."
OBSERVATION = "Tool output (turn {turn}): exit status 1, ModuleNotFoundError in module {e}."
ARMS = {"llama-cpp-python": (("prompt-cache", ["--cache", "true"]), ("reuse", ["--cache", "false"])),
        "llama-server": (("prompt-cache", ["--cache-ram", "64"]), ("reuse", ["--cache-ram", "0"]))}
"""Per server, the two runs: their arm label and the server's own flags for it."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", type=http_url,
                        help="OpenAI base URL of a server already running (default: start one per run)")
    parser.add_argument("--model", type=input_file, help="GGUF model to serve (default: a generated tiny model)")
    parser.add_argument("--server", choices=sorted(ARMS), default="llama-cpp-python",
                        help="which server to start (default llama-cpp-python)")
    parser.add_argument("--llama-server", type=input_file,
                        help="llama-server binary (default: on PATH, else kvtrace's own build)")
    parser.add_argument("--threads", type=count, default=1, help="server threads (default 1)")
    parser.add_argument("--episodes", type=count, default=3)
    parser.add_argument("--turns", type=count, default=3)
    parser.add_argument("--max-tokens", type=count, default=8)
    parser.add_argument("--run-prefix", default=f"agent-example-{time.strftime('%Y%m%dT%H%M%S')}")
    return parser.parse_args(argv)


def agent_run(base_url: str, run_id: str, arm: str, args: argparse.Namespace) -> list[dict]:
    """The episodes, turn by turn; one ``{run, episode, turn, output}`` per request."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    try:
        return episodes(client, run_id, arm, args)
    except openai.APIError as exc:
        raise SystemExit(f"{base_url}: {exc} (is an OpenAI-compatible server answering there?)") from None


def episodes(client: openai.OpenAI, run_id: str, arm: str, args: argparse.Namespace) -> list[dict]:
    model = client.models.list().data[0].id
    histories = {f"e{e}": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK.format(e=e)}]
                 for e in range(args.episodes)}
    seen = []
    for turn in range(args.turns):
        for episode, messages in histories.items():
            headers: dict[str, str] = {}
            with correlate(run_id=run_id, episode_id=episode, turn=turn, arm=arm or None):
                propagate.inject(headers)  # baggage: kvtrace.run_id=...,kvtrace.episode_id=...,kvtrace.turn=...
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                   temperature=0.0, extra_headers=headers)
            text = reply.choices[0].message.content or ""
            seen.append({"run": run_id, "episode": episode, "turn": turn, "output": text})
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": OBSERVATION.format(turn=turn, e=episode)}]
    print(f"{run_id}: {len(seen)} requests answered", flush=True)
    return seen


@contextlib.contextmanager
def llama_cpp_python(model: Path, flags: list[str], env: dict[str, str], args, logs: Path) -> Iterator[str]:
    with traced_llama_cpp_server(model, flags, env, args.threads, logs / "server.log") as base_url:
        yield base_url


@contextlib.contextmanager
def llama_server_behind_proxy(model: Path, flags: list[str], env: dict[str, str], args, logs: Path) -> Iterator[str]:
    binary = args.llama_server.resolve() if args.llama_server else shutil.which("llama-server") or cached_llama_server()
    if binary is None:
        raise SystemExit("no llama-server found: give --llama-server PATH, or build kvtrace's own with "
                         "`python -m kvtrace.llama_server.build`")
    port, proxy_port = free_port(), free_port()
    log = logs / "llama-server.log"
    log.unlink(missing_ok=True)  # the proxy reads this run's decisions only
    server = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "1024",
              "-t", str(args.threads), "-tb", str(args.threads), "--no-warmup", "-lv", "4", "--log-file", str(log),
              *flags]
    proxy = ["kvtrace", "proxy", "--upstream", f"http://127.0.0.1:{port}", "--listen", f"127.0.0.1:{proxy_port}",
             "--llama-server-log", str(log)]
    echo({}, server + ["&"])
    echo(env, proxy)
    with started(server, f"http://127.0.0.1:{port}/health", logs / "llama-server.out"):
        with started([*kvtrace_command(), *proxy[1:]], f"http://127.0.0.1:{proxy_port}/v1/models",
                     logs / "proxy.log", env={**os.environ, **env}):
            yield f"http://127.0.0.1:{proxy_port}/v1"


SERVERS = {"llama-cpp-python": llama_cpp_python, "llama-server": llama_server_behind_proxy}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    seen, runs, model = [], [], args.model and args.model.resolve()  # the servers run in their logs' folder
    if args.url:
        for run_id in (f"{args.run_prefix}/first", f"{args.run_prefix}/second"):
            seen += agent_run(args.url, run_id, "", args)
            runs.append(run_id)
    else:
        model = model or generated_model("agent-example")
        env = {} if args.model else {"KVTRACE_CAPTURE": "ids"}  # a generated model's token ids reveal nothing
        logs = work_dir("agent-loop")
        for arm, flags in ARMS[args.server]:
            run_id = f"{args.run_prefix}/{arm}"
            with SERVERS[args.server](model, flags, env, args, logs) as base_url:
                seen += agent_run(base_url, run_id, arm, args)
            runs.append(run_id)  # the server has stopped: its spans are in the spool
    print_differences(seen, *runs)
    kvtrace("db", "ingest")
    kvtrace("runs")
    kvtrace("diff", *runs, *(["--model", str(model)] if model else []))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
