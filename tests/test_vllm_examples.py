"""examples/vllm_offline.py as a user runs it: from another working directory, with kvtrace
installed in vLLM's environment, on the generated tiny model.

The story: the same three agent episodes run twice on vLLM's offline API, once keeping the prefix
cache and once resetting it before every request. The script ingests the spans, lists the runs
and diffs them; what it prints agrees with what it stored, and the diff's verdict with the outputs
the script itself got back from vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from example_scripts import check_the_diff, run_example, section, stored_requests  # noqa: E402
from kvtrace import semconv as sc  # noqa: E402

PREFIX = "vllm-example"
EPISODES, TURNS = 3, 3


def test_two_vllm_runs_one_with_the_prefix_cache_are_ingested_listed_and_diffed(kvtrace_env, tmp_path, capsys):
    out = run_example("vllm_offline.py", "--run-prefix", PREFIX, "--episodes", str(EPISODES), "--turns", str(TURNS),
                      "--max-tokens", "6", cwd=tmp_path / "elsewhere", timeout=400)
    hits, cold = f"{PREFIX}/prefix", f"{PREFIX}/off"

    rows = stored_requests(kvtrace_env / "db", "arm, reused_tokens, cache_layer, length(token_ids), engine")
    by_run = {run: [r for r in rows if r[0] == run] for run in (hits, cold)}
    for run, arm in ((hits, "prefix"), (cold, "off")):
        assert [(r[1], r[2]) for r in by_run[run]] == [(f"e{e}", t) for e in range(EPISODES) for t in range(TURNS)]
        assert all(r[3] == arm and r[6] == 6 and r[7] == "vllm" for r in by_run[run])
    # Later turns extend the earlier ones: with the cache kept they start from its blocks; reset, never.
    assert all(r[4] > 0 and r[5] == sc.LAYER_PREFIX_BLOCKS for r in by_run[hits] if r[2] > 0)
    assert all(r[4] == 0 and r[5] == sc.LAYER_NONE for r in by_run[cold])
    cached = sum(r[4] for r in by_run[hits])
    assert f"{hits}: {EPISODES * TURNS} requests, {cached} prompt tokens from the prefix cache" in out
    assert f"{cold}: {EPISODES * TURNS} requests, 0 prompt tokens from the prefix cache" in out

    assert section(out, "db ingest")[0].startswith(f"kvtrace: ingested {2 * EPISODES * TURNS} spans")
    listed = section(out, "runs")
    assert listed[0].split()[:2] == ["run_id", "engine"]
    assert sorted(line.split()[0] for line in listed[1:]) == sorted([hits, cold])

    check_the_diff(out, hits, cold, EPISODES, capsys)
