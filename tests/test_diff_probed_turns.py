"""A probe's cold and warm requests to a server kvtrace traces, compared with ``kvtrace diff --turns``.

The story: ``kvtrace probe`` sent each of two prompts to a vLLM server cold (turn 0), then warm
twice (turns 1 and 2), in run ``canary``.  Every request is recorded twice: by the probe, from
outside (what the response said), and by the engine, as the child of the probe's span.  The
second warm request of ``chat`` reused prefix blocks that the first warm one stored, and its
second token flipped at a near tie.  ``kvtrace diff canary canary --turns 0,2`` compares the
cold turn with the second warm one from the engine's records: the fork, the prefix-block lookup
that caused it and the request that stored the blocks; for ``plain``, which did not fork, both
cache paths.  ``kvtrace runs`` and ``margin_shift`` count every request once.
"""

from __future__ import annotations

import json

import pytest

from diff_scenarios import CachePath, RECOMPUTE, ScenarioBook
from kvtrace import semconv as sc
from kvtrace.cli import main

RUN = "canary"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
COLD_TOKENS, WARM_TOKENS = [10, 11, 12], [10, 13, 12]
OUTSIDE = {sc.CACHE_REUSED_TOKENS_SOURCE: sc.REUSED_SOURCE_OPENAI_USAGE, sc.PROBE_ROLE: sc.PROBE_ROLE_WARM}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("probed")
    book = ScenarioBook(root / "spool")
    engine_records = {}

    def request(episode, turn, tokens, margins, cache=RECOMPUTE, engine_cache=None):
        """The probe's record of one request, then the engine's, as its child."""
        seen = book.turn(RUN, episode, turn, PROMPT, tokens, margins, cache=cache, arm="probe", engine="vllm",
                         config=OUTSIDE)
        engine_records[(episode, turn)] = book.turn(RUN, episode, turn, PROMPT, tokens, margins,
                                                    cache=engine_cache or cache, arm="probe", engine="vllm",
                                                    parent=seen)

    for episode in ("chat", "plain"):
        request(episode, 0, COLD_TOKENS, [1.0, 0.02, 1.0])
        request(episode, 1, COLD_TOKENS, [1.0, 0.02, 1.0])
        stored = engine_records[(episode, 1)].origin()
        # The response only says 8 tokens were cached; the engine knows which blocks, and who stored them.
        hit = CachePath(sc.LAYER_PREFIX_BLOCKS, 8, event=sc.EVENT_CACHE_LOOKUP, origin=stored,
                        block_hashes=["b1", "b2"])
        request(episode, 2, WARM_TOKENS if episode == "chat" else COLD_TOKENS, [1.0, 0.01, 1.0],
                cache=CachePath(sc.LAYER_PREFIX_BLOCKS, 8), engine_cache=hit)
    url = f"chdb://{root / 'db'}"
    client = connect(url)
    init_schema(client)
    book.ingest(client)
    client.close()
    return {"url": url, "spool": str(root / "spool"), "engine": engine_records}


def kvtrace(probed, *args):
    return main(["--db", probed["url"], "--spool-dir", probed["spool"], "-q", *args])


def test_diff_of_cold_and_warm_turns_reads_the_engines_records(probed, capsys):
    assert kvtrace(probed, "diff", RUN, RUN, "--turns", "0,2", "--format", "json") == 0
    (fork,) = json.loads(capsys.readouterr().out)
    cold, warm, stored_by = (probed["engine"][("chat", t)] for t in (0, 2, 1))
    assert (fork["episode"], fork["turn"], fork["position"], fork["attribution"]) == (
        "chat", 2, 1, sc.ATTRIBUTION_HIT_VS_RECOMPUTE)
    assert (fork["a"]["span_id"], fork["b"]["span_id"]) == (cold.span_id, warm.span_id)
    assert (fork["a"]["token"], fork["b"]["token"]) == (11, 13)
    culprit = fork["culprit"]
    assert (culprit["span_id"], culprit["event"], culprit["layer"], culprit["block_hashes"]) == (
        warm.span_id, sc.EVENT_CACHE_LOOKUP, sc.LAYER_PREFIX_BLOCKS, ["b1", "b2"])
    assert culprit["source"] == {"request_id": stored_by.correlation.request_id, "run_id": RUN,
                                 "episode_id": "chat", "turn": 1, "span_id": stored_by.span_id}


def test_diff_text_shows_both_cache_paths_of_the_episode_that_did_not_fork(probed, capsys):
    assert kvtrace(probed, "diff", RUN, RUN, "--turns", "0,2") == 0
    out = capsys.readouterr().out
    assert "canary turn 0 vs canary turn 2: 1 of 2 episode(s) forked" in out
    assert "episode chat: forked at turn 2, token 1 [hit_vs_recompute]" in out
    assert ("episode plain: A recomputed all 9 prompt tokens | B prefix_blocks: reused 8 of 9 prompt tokens, "
            "state from episode plain turn 1") in out


def test_runs_and_margin_shift_count_each_probed_request_once(probed, capsys):
    assert kvtrace(probed, "runs", "--format", "json") == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert (run["run_id"], run["episodes"], run["requests"], run["cached_prompt_tokens"]) == (RUN, 2, 6, 16)
    assert kvtrace(probed, "query", "margin_shift", "--param", f"run_prefix={RUN}", "--format", "json") == 0
    rows = json.loads(capsys.readouterr().out)
    everything = next(r for r in rows if r["weight_format"] == "(all)")
    assert everything["request_pairs"] == 2  # the engine's two warm hits, each against its cold turn


def exit_code(probed, *args) -> int:
    try:
        return kvtrace(probed, *args)
    except SystemExit as exc:  # argparse refuses the value while parsing
        return exc.code


@pytest.mark.parametrize("args, message", [
    (["--turns", "0"], "argument --turns: '0' is not two turn numbers A,B"),
    (["--turns", "0,-1"], "argument --turns: '0,-1' is not two turn numbers A,B"),
    (["--turns", "0,2", "--html", "view.html"], "--html draws both runs' whole episodes"),
])
def test_bad_turns_are_refused_in_one_line(probed, capsys, tmp_path, args, message):
    args = [a.replace("view.html", str(tmp_path / "view.html")) for a in args]
    assert exit_code(probed, "diff", RUN, RUN, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
