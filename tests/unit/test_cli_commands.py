"""Every command is one line of ``kvtrace.cli.COMMANDS`` and a module; ``kvtrace --help`` lists them all
without importing any, and a command line imports only what its own command needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvtrace.commands
from kvtrace.cli import COMMANDS, main

LOADED = """
import json, sys
from kvtrace.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stdout.flush()
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def modules_loaded_by(*argv: str) -> tuple[str, set[str]]:
    """What ``kvtrace ARGV`` printed and every module it had imported when it ended, in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=120)
    return proc.stdout, set(json.loads(proc.stderr.splitlines()[-1]))


def test_help_lists_every_command_without_importing_one():
    shown, loaded = modules_loaded_by("--help")
    for name, command in COMMANDS.items():
        assert name in shown and command.summary[:40] in " ".join(shown.split())
    assert not {command.module for command in COMMANDS.values()} & loaded
    assert "clickhouse_connect" not in loaded and "chdb" not in loaded


def test_a_command_line_imports_its_command_and_not_the_others():
    shown, loaded = modules_loaded_by("diff", "--help")
    assert "usage: kvtrace diff" in shown and "--near-tie" in shown
    assert "kvtrace.commands.diff" in loaded
    assert not {"kvtrace.commands.experiment", "kvtrace.commands.alert", "kvtrace.experiment"} & loaded
    assert "clickhouse_connect" not in loaded, "--help must not load the database client (chDB)"


def test_proxy_help_loads_its_limits_and_not_the_http_layer():
    """kvtrace/proxy/__init__.py stays empty, so the proxy's defaults come without h11 or the relay."""
    shown, loaded = modules_loaded_by("proxy", "--help")
    assert "usage: kvtrace proxy" in shown and "kvtrace.proxy.limits" in loaded
    assert not {"h11", "kvtrace.proxy.app", "kvtrace.proxy.http1", "kvtrace.proxy.upstream"} & loaded


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_listed_command_builds_its_help(name, capsys):
    with pytest.raises(SystemExit) as ended:
        main([name, "--help"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvtrace {name} [-h]")


def test_every_command_module_is_listed():
    """A module with ``add_arguments`` that the table forgot would be a command nobody can run."""
    listed = {command.module for command in COMMANDS.values()}
    folder = Path(kvtrace.commands.__file__).parent
    defining = {f"kvtrace.commands.{path.stem}" for path in folder.glob("*.py")
                if "\ndef add_arguments(" in path.read_text(encoding="utf-8")}
    assert defining == listed, "a command module is one line of kvtrace.cli.COMMANDS"
