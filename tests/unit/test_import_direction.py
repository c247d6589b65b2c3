"""Imports run with the flow (docs/ARCHITECTURE.md): collectors import recording, recording never imports
collectors; the ClickHouse sink that stores as ingest does is found by its entry point."""

from __future__ import annotations

import ast
from importlib.metadata import entry_points
from pathlib import Path

import kvtrace.recording

RECORDING = Path(kvtrace.recording.__file__).parent


def _imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [None])} - {None}


def test_no_recording_module_imports_collectors():
    offenders = {str(path.relative_to(RECORDING)): sorted(name for name in _imported(path) if "collectors" in name)
                 for path in RECORDING.rglob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_clickhouse_exporter_recording_can_choose_is_collectors_sink():
    (found,) = entry_points(group="kvtrace.exporters", name="clickhouse")
    from kvtrace.collectors.sink import ClickHouseSpanExporter

    assert found.load() is ClickHouseSpanExporter
