"""The example scripts (examples/*.py) run for real, as a user runs them: a fresh interpreter in
another working directory, with the installed kvtrace, the generated tiny model and real servers.
What each prints is held to what it stored. (examples/vllm_offline.py: tests/test_vllm_examples.py.)
"""

from __future__ import annotations

import pytest

from example_scripts import check_the_diff, run_example, section, stored_requests
from kvtrace import semconv as sc

pytest.importorskip("llama_cpp.server.app")
pytest.importorskip("openai")

EPISODES, TURNS = 3, 3


# --- examples/agent_loop.py -------------------------------------------------------------------------


def test_an_agent_loop_runs_with_and_without_the_prompt_cache_and_the_diff_says_whether_it_forked(
        kvtrace_env, tmp_path, capsys):
    out = run_example("agent_loop.py", "--run-prefix", "agents", "--episodes", str(EPISODES), "--turns", str(TURNS),
                      "--max-tokens", "6", cwd=tmp_path / "elsewhere")
    cached, uncached = "agents/prompt-cache", "agents/reuse"
    assert f"{cached}: {EPISODES * TURNS} requests answered" in out

    rows = stored_requests(kvtrace_env / "db", "arm, operation, prompt_tokens, reused_tokens, cache_layer, "
                                               "source_episode_id, source_turn, length(token_ids), length(margins)")
    by_run = {run: {(r[1], r[2]): r for r in rows if r[0] == run} for run in (cached, uncached)}
    for run in by_run:
        assert sorted(by_run[run]) == [(f"e{e}", t) for e in range(EPISODES) for t in range(TURNS)]
        assert all(r[3] == run.split("/")[1] and r[4] == sc.OPERATION_CHAT and 0 < r[10] == r[11] <= 6
                   for r in by_run[run].values())
    # Interleaved, each later turn finds another episode in the context. With the prompt cache it is
    # restored from the state its own previous turn stored; without, only the shared system prompt is reused.
    for (episode, turn), r in by_run[cached].items():
        if turn > 0:
            assert r[7] == sc.LAYER_PROMPT_CACHE and (r[8], r[9]) == (episode, turn - 1)
            other = by_run[uncached][(episode, turn)]
            assert 0 < other[6] < r[6] < r[5] and other[7] == sc.LAYER_KV_REUSE

    assert section(out, "db ingest")[0].startswith(f"kvtrace: ingested {2 * EPISODES * TURNS} spans")
    listed = {line.split()[0]: line.split() for line in section(out, "runs")[1:]}
    assert sorted(listed) == [cached, uncached]
    assert listed[cached][1:3] == ["llama_cpp", str(tmp_path / "data" / "kvtrace" / "models" /
                                                    "agent-example-tiny-F32.gguf")]
    check_the_diff(out, cached, uncached, EPISODES, capsys)
