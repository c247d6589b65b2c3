"""The example scripts (examples/*.py) run for real, as a user runs them: a fresh interpreter in
another working directory, with the installed kvtrace, the generated tiny model and real servers.
What each prints is held to what it stored. (examples/vllm_offline.py: tests/test_vllm_examples.py.)
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest

from example_scripts import check_the_diff, run_example, section, stored_requests
from llama_server_process import llama_server_binary
from kvtrace import semconv as sc
from kvtrace.cli import main

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



def test_the_agent_loop_through_kvtrace_proxy_in_front_of_llama_server(kvtrace_env, tmp_path, capsys):
    llama_server_binary()  # the script finds kvtrace's own build, as a user's would
    out = run_example("agent_loop.py", "--server", "llama-server", "--run-prefix", "proxied", "--episodes",
                      str(EPISODES), "--turns", str(TURNS), "--max-tokens", "6", cwd=tmp_path / "elsewhere")
    cached, uncached = "proxied/prompt-cache", "proxied/reuse"
    rows = stored_requests(kvtrace_env / "db", "arm, engine, reused_tokens, cache_layer, source_episode_id, "
                                               "source_turn, length(token_ids), length(margins)")
    by_run = {run: {(r[1], r[2]): r for r in rows if r[0] == run} for run in (cached, uncached)}
    for run in by_run:
        assert sorted(by_run[run]) == [(f"e{e}", t) for e in range(EPISODES) for t in range(TURNS)]
        assert all(r[3] == run.split("/")[1] and r[4] == "llama-server" and 0 < r[9] == r[10] <= 6
                   for r in by_run[run].values())
    # The server's log, read by the proxy, names each prompt-cache restore's origin: the episode's own
    # earlier turn. With --cache-ram 0 there is none.
    restored = [(key, r) for key, r in by_run[cached].items() if r[6] == sc.LAYER_PROMPT_CACHE]
    assert restored and all((r[7], r[8]) == (episode, turn - 1) for (episode, turn), r in restored)
    assert not any(r[6] == sc.LAYER_PROMPT_CACHE for r in by_run[uncached].values())
    check_the_diff(out, cached, uncached, EPISODES, capsys)


# --- examples/alerting.py ---------------------------------------------------------------------------


def test_a_probe_of_a_traced_server_fires_a_rule_that_reaches_the_alertmanager_on_the_example_route(
        kvtrace_env, tmp_path, capsys):
    if not (shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")):
        pytest.skip("no Alertmanager binary (apt-get install prometheus-alertmanager)")
    out = run_example("alerting.py", "--run-id", "canary", cwd=tmp_path / "elsewhere")
    # Per example prompt: a flush request (in no episode; the engine's record only), then the cold request
    # (turn 0) and 4 warm ones, each recorded by the probe and, in the same trace, by the traced engine.
    rows = [r for r in stored_requests(kvtrace_env / "db", "engine") if r[0] == "canary"]
    assert {r[3] for r in rows} == {"llama_cpp"}
    probed = Counter((r[1], r[2]) for r in rows)
    assert probed == Counter({("", -1): 3, **{(p, t): 2 for p in ("plain-completion", "summary", "tool-call")
                                              for t in range(5)}})

    # The random-weight model's decisions are often near ties: the example rule for them fires, at the
    # share the stored spans give, and nothing else does (its cache paths move margins by ~1e-5 at most).
    capsys.readouterr()
    assert main(["-q", "query", "near_tie_share", "--format", "json"]) == 0
    (measured,) = json.loads(capsys.readouterr().out)
    assert measured["engine"] == "llama_cpp" and measured["near_tie_share"] > 0.02 and measured["positions"] >= 500
    (firing,) = [line for line in section(out, "alert") if "FIRING" in line]
    assert (f"FIRING   near-ties-on-cache-hits: share of near-tie decisions on cache-hit paths: "
            f"{measured['near_tie_share']:.4g} > 0.02") in firing and f"[{measured['positions']} samples]" in firing

    # What the Alertmanager's API answered: the alert, active, on examples/alertmanager.yml's kvtrace route.
    held = out.split("/api/v2/alerts holds ", 1)[1].splitlines()
    assert held[0] == "1 kvtrace alert(s)"
    assert held[1].startswith("  active near-ties-on-cache-hits -> receiver kvtrace-oncall: ")
    labels = dict(pair.split("=", 1) for pair in held[2].strip().split(", "))
    assert labels == {"alertname": "near-ties-on-cache-hits", "engine": "llama_cpp", "metric": "near_tie_share",
                      "model": measured["model"], "severity": "warning", "source": "kvtrace", "weight_format": "F32"}
