"""A wheel built from the repo installs in a fresh venv and its CLI works (patches, collectors, queries included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_the_cli_runs(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(wheels.glob("kvtrace-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    kvtrace = str(venv / "bin" / "kvtrace")

    def run(*args):
        proc = subprocess.run([kvtrace, *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "usage: kvtrace" in run("--help")
    assert "schema ready" in run("db", "init")
    assert "selfcheck passed" in run("selfcheck", "--requests", "4")
    assert "run_id" in run("query", "runs")
    located = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import kvtrace.patches, kvtrace.collectors, kvtrace.queries as q; "
                              "import kvtrace.exchanges.probe, kvtrace.llama_server.build, kvtrace.proxy.limits; "
                              "print(kvtrace.patches.__file__); print(q.names())"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
    assert str(venv) in located and "runs" in located
