"""examples/vllm_offline.py as a user runs it: from another working directory, with kvtrace
installed in vLLM's environment, on the generated tiny model.

The story: the same three agent episodes run twice on vLLM's offline API, once keeping the prefix
cache and once resetting it before every request. The script ingests the spans, lists the runs
and diffs them; what it prints agrees with what it stored, and the diff's verdict with the outputs
the script itself got back from vLLM.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtrace import semconv as sc  # noqa: E402
from kvtrace.cli import main  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "vllm_offline.py"
PREFIX = "vllm-example"
EPISODES, TURNS = 3, 3


def stored_requests(db_path: Path) -> list[tuple]:
    from kvtrace.db import connect

    client = connect(f"chdb://{db_path}")
    try:
        return client.query(
            "SELECT run_id, arm, episode_id, turn, reused_tokens, cache_layer, length(token_ids), engine "
            "FROM kvtrace_requests ORDER BY run_id, episode_id, turn").result_rows
    finally:
        client.close()


def test_two_vllm_runs_one_with_the_prefix_cache_are_ingested_listed_and_diffed(kvtrace_env, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, str(SCRIPT), "--run-prefix", PREFIX, "--episodes", str(EPISODES),
                           "--turns", str(TURNS), "--max-tokens", "6"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    hits, cold = f"{PREFIX}/prefix", f"{PREFIX}/off"

    rows = stored_requests(kvtrace_env / "db")
    by_run = {run: [r for r in rows if r[0] == run] for run in (hits, cold)}
    for run, arm in ((hits, "prefix"), (cold, "off")):
        assert sorted((r[2], r[3]) for r in by_run[run]) == sorted(
            (f"e{e}", t) for e in range(EPISODES) for t in range(TURNS))
        assert all(r[1] == arm and r[6] == 6 and r[7] == "vllm" for r in by_run[run])
    # Later turns extend the earlier ones: with the cache kept they start from its blocks; reset, never.
    assert all(r[4] > 0 and r[5] == sc.LAYER_PREFIX_BLOCKS for r in by_run[hits] if r[3] > 0)
    assert all(r[4] == 0 and r[5] == sc.LAYER_NONE for r in by_run[cold])
    cached = sum(r[4] for r in by_run[hits])
    assert f"{hits}: {EPISODES * TURNS} requests, {cached} prompt tokens from the prefix cache" in out
    assert f"{cold}: {EPISODES * TURNS} requests, 0 prompt tokens from the prefix cache" in out

    assert f"$ kvtrace db ingest\nkvtrace: ingested {2 * EPISODES * TURNS} spans" in out
    listed = out.split("$ kvtrace runs\n", 1)[1].split("\n$ ", 1)[0].splitlines()
    assert listed[0].split()[:2] == ["run_id", "engine"]
    assert sorted(line.split()[0] for line in listed[1:]) == sorted([hits, cold])

    # The verdict the script printed is the one the stored spans give, and matches what vLLM returned.
    said = re.search(r"^outputs differ: (.*)$", out, re.M).group(1)
    differ = {} if said.startswith("none") else {
        e: int(t) for e, t in re.findall(r"(e\d+) from turn (\d+)", said)}
    capsys.readouterr()
    assert main(["-q", "diff", hits, cold, "--format", "json"]) == 0
    forks = json.loads(capsys.readouterr().out)
    assert {f["episode"]: f["turn"] for f in forks} == differ
    assert f"{hits} vs {cold}: {len(differ)} of {EPISODES} episode(s) forked (outputs compared by token ids)" in out
