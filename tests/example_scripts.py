"""Running examples/*.py as a user does, for tests/test_examples.py and tests/test_vllm_examples.py:
a fresh interpreter, another working directory, the test's kvtrace environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from kvtrace.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, cwd: Path, timeout: int = 300) -> str:
    """The script's standard output; it must exit 0."""
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def stored_requests(db_path: Path, columns: str) -> list[tuple]:
    """``columns`` of every stored request, by run, episode and turn."""
    from kvtrace.db import connect

    client = connect(f"chdb://{db_path}")
    try:
        return client.query(f"SELECT run_id, episode_id, turn, {columns} FROM kvtrace_requests "
                            "ORDER BY run_id, episode_id, turn").result_rows
    finally:
        client.close()


def section(out: str, command: str) -> list[str]:
    """What the script printed for ``$ kvtrace COMMAND ...``, line by line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ kvtrace {command}")) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("$ ")), len(lines))
    return [line for line in lines[start:end] if line.strip()]


def check_the_diff(out: str, run_a: str, run_b: str, episodes: int, capsys) -> dict[str, int]:
    """The script's own account (``outputs differ: ...``), the diff it printed and the diff of the stored
    spans agree; returns the forked episodes with their first differing turn."""
    said = re.search(r"^outputs differ: (.*)$", out, re.M).group(1)
    differ = {} if said.startswith("none") else {e: int(t) for e, t in re.findall(r"(\S+) from turn (\d+)", said)}
    printed = section(out, f"diff {run_a} {run_b}")
    assert printed[0] == (f"{run_a} vs {run_b}: {len(differ)} of {episodes} episode(s) forked "
                          "(outputs compared by token ids)")
    capsys.readouterr()
    assert main(["-q", "diff", run_a, run_b, "--format", "json"]) == 0
    forks = json.loads(capsys.readouterr().out)
    assert {f["episode"]: f["turn"] for f in forks} == differ
    for fork in forks:
        assert f"episode {fork['episode']}: forked at turn {fork['turn']}" in "\n".join(printed)
    return differ
