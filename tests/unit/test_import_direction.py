"""Imports run with the flow (docs/ARCHITECTURE.md): collectors import recording, recording never imports
collectors; the ClickHouse sink that stores as ingest does is found by its entry point. Commands never
import one another: what two share lives outside commands/ or in its shared modules."""

from __future__ import annotations

import ast
from importlib.metadata import entry_points
from pathlib import Path

import kvtrace.commands
import kvtrace.recording
from kvtrace.cli import COMMANDS

RECORDING = Path(kvtrace.recording.__file__).parent
COMMAND_FOLDER = Path(kvtrace.commands.__file__).parent


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function; ``from A import B`` names both A and
    A.B (B may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_recording_module_imports_collectors():
    offenders = {str(path.relative_to(RECORDING)): sorted(name for name in _imported(path) if "collectors" in name)
                 for path in RECORDING.rglob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_clickhouse_exporter_recording_can_choose_is_collectors_sink():
    (found,) = entry_points(group="kvtrace.exporters", name="clickhouse")
    from kvtrace.collectors.sink import ClickHouseSpanExporter

    assert found.load() is ClickHouseSpanExporter


def test_no_command_imports_another_command():
    """A flow two commands share lives outside commands/ (kvtrace/experiment/, commands/common.py …), so
    no command is another's library and no import circle can form between them."""
    command_modules = {command.module for command in COMMANDS.values()}
    offenders = {path.name: sorted(name for name in _imported(path) & command_modules
                                   if name != f"kvtrace.commands.{path.stem}")
                 for path in COMMAND_FOLDER.glob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}
