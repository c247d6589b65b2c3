"""``kvtrace run -- COMMAND...``: run any Python command with kvtrace's engine patches.

Settings are checked first (``kvtrace/preflight.py``): a value the engine
could not record with is refused with exit code 2 before anything starts.
The command gets ``kvtrace/bootstrap`` prepended to ``PYTHONPATH``; Python
imports its ``sitecustomize`` at start-up (in the command and in every Python
subprocess it starts), which registers the lazy engine patches.  The command
then replaces this process (``exec``), so signals reach it directly and its
exit status is the exit status of ``kvtrace run``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import kvtrace.bootstrap
from kvtrace.semconv import CAPTURE_MODES
from kvtrace.config import ENABLED_VARIABLE
from kvtrace.errors import ConfigError
from kvtrace.preflight import check_settings

BOOTSTRAP_DIR = str(Path(kvtrace.bootstrap.__file__).resolve().parent)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Run COMMAND with kvtrace's engine patches loaded at Python start-up; no code changes "
                          "needed. Example: kvtrace run -- python -m llama_cpp.server --model m.gguf --cache true")
    parser.add_argument("--run-id", default=None, help="run id for requests without baggage (env KVTRACE_RUN_ID)")
    parser.add_argument("--capture", choices=CAPTURE_MODES, default=None,
                        help="token capture policy (env KVTRACE_CAPTURE)")
    parser.add_argument("--engines", default=None, metavar="LIST",
                        help="comma-separated engines to patch (default: all supported; env KVTRACE_ENGINES)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    parser.set_defaults(func=run)


def child_environment(base: dict[str, str], args: argparse.Namespace) -> dict[str, str]:
    """The wrapped command's environment: bootstrap first on PYTHONPATH, kvtrace options as env, and
    the opt-in that engines loading kvtrace by themselves (vLLM's plugin) wait for."""
    env = dict(base)
    env[ENABLED_VARIABLE] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *paths])
    for name, value in (("KVTRACE_RUN_ID", args.run_id), ("KVTRACE_CAPTURE", args.capture),
                        ("KVTRACE_ENGINES", args.engines)):
        if value:
            env[name] = value
    return env


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command given; usage: kvtrace run -- python -m llama_cpp.server --model M.gguf")
    env = child_environment(dict(os.environ), args)
    check_settings(env)  # a setting the engine could not record with is refused now, not found missing later
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"kvtrace: error: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"kvtrace: error: command not executable: {command[0]}", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process
