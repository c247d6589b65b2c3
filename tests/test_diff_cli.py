"""``kvtrace diff`` and ``kvtrace runs`` on two recorded runs: a cache hit forks one episode,
the other episode agrees; diff names the fork, the culprit event and its provenance."""

from __future__ import annotations

import json

import pytest

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import semconv as sc
from kvtrace.cli import main
from readme_commands import readme_kvtrace_args

A, B = "cli-A", "cli-B"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("diff")
    book = ScenarioBook(root / "spool")
    for run in (A, B):
        book.turn(run, "agent-1", 0, PROMPT, [10, 11, 12], arm="reuse" if run == A else "off")
        book.turn(run, "agent-2", 0, PROMPT + [9], [10, 11], arm="reuse" if run == A else "off")
    stored = book.records[(A, "agent-1", 0)].origin()
    restore = CachePath(sc.LAYER_PROMPT_CACHE, 11, "key-1", stored, sc.EVENT_CACHE_RESTORE)
    # As kvtrace proxy records llama-server: A's slot held the conversation, B's was taken as least recently used.
    book.turn(A, "agent-1", 1, PROMPT + [10, 11, 12, 20], [40, 41, 42], [1.0, 0.01, 1.0], cache=restore, arm="reuse",
              config={sc.SERVER_SLOT_SELECTED_BY: sc.SLOT_SELECTED_BY_LCP_SIMILARITY})
    book.turn(B, "agent-1", 1, PROMPT + [10, 11, 12, 20], [40, 43, 42], [1.0, 0.02, 1.0], arm="off",
              config={sc.SERVER_SLOT_SELECTED_BY: sc.SLOT_SELECTED_BY_LRU})
    url = f"chdb://{root / 'db'}"
    client = connect(url)
    init_schema(client)
    book.ingest(client)
    yield {"url": url, "spool": str(root / "spool"), "book": book, "root": root}
    client.close()


def kvtrace(recorded, *args):
    return main(["--db", recorded["url"], "--spool-dir", recorded["spool"], "-q", *args])


def test_diff_json_lists_the_fork_with_culprit_and_provenance(recorded, capsys):
    assert kvtrace(recorded, "diff", A, B, "--format", "json") == 0
    (fork,) = json.loads(capsys.readouterr().out)
    stored_by = recorded["book"].records[(A, "agent-1", 0)]
    assert (fork["episode"], fork["turn"], fork["position"], fork["attribution"]) == (
        "agent-1", 1, 1, "hit_vs_recompute")
    assert (fork["run_a"], fork["run_b"]) == (A, B)
    assert (fork["a"]["token"], fork["b"]["token"]) == (41, 43)
    assert (fork["a"]["margin"], fork["b"]["margin"], fork["near_tie"]) == (0.01, 0.02, True)
    assert (fork["a"]["cache"]["slot_selected_by"], fork["b"]["cache"]["slot_selected_by"]) == (
        sc.SLOT_SELECTED_BY_LCP_SIMILARITY, sc.SLOT_SELECTED_BY_LRU)
    culprit = fork["culprit"]
    assert (culprit["run"], culprit["event"], culprit["layer"], culprit["reused_tokens"]) == (
        A, sc.EVENT_CACHE_RESTORE, sc.LAYER_PROMPT_CACHE, 11)
    assert culprit["source"] == {"request_id": stored_by.correlation.request_id, "run_id": A,
                                 "episode_id": "agent-1", "turn": 0, "span_id": stored_by.span_id}


def test_diff_text_reads_as_a_post_mortem(recorded, capsys):
    assert kvtrace(recorded, *readme_kvtrace_args("kvtrace diff RUN_A RUN_B", {"RUN_A": A, "RUN_B": B})) == 0
    out = capsys.readouterr().out
    assert "1 of 2 episode(s) forked" in out
    assert "episode agent-1: forked at turn 1, token 1 [hit_vs_recompute]" in out
    assert "restored state <- stored by request" in out and "episode agent-1, turn 0, run cli-A" in out
    assert "reused 11 of 12 prompt tokens, state from episode agent-1 turn 0; slot chosen by prompt similarity" in out
    assert "recomputed all 12 prompt tokens; slot chosen as least recently used" in out
    assert "not forked (1): agent-2" in out


def test_diff_of_agreeing_episodes_exits_zero(recorded, capsys):
    assert kvtrace(recorded, "diff", A, B, "--episode", "agent-2", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out) == []


def test_unknown_run_is_an_error_that_says_what_to_do(recorded, capsys):
    assert kvtrace(recorded, "diff", A, "no-such-run") == 1
    err = capsys.readouterr().err
    assert "no run 'no-such-run'" in err and "kvtrace runs" in err


def test_runs_lists_both_runs_with_their_arms(recorded, capsys):
    assert kvtrace(recorded, "runs", "--format", "json") == 0
    runs = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(runs) == {A, B}
    assert (runs[A]["arms"], runs[A]["episodes"], runs[A]["requests"], runs[A]["cached_prompt_tokens"]) == (
        "reuse", 2, 3, 11)
    assert kvtrace(recorded, "runs", "--format", "csv") == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("run_id,engine,model")


def test_runs_table_shows_each_run_with_its_cached_tokens(recorded, capsys):
    assert kvtrace(recorded, *readme_kvtrace_args("kvtrace runs")) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["run_id", "engine", "model"]
    by_run = {row.split()[0]: row.split() for row in rows if row.split() and row.split()[0] in (A, B)}
    assert set(by_run) == {A, B}
    assert "11" in by_run[A] and "reuse" in by_run[A] and "off" in by_run[B]


def test_model_vocabulary_turns_ids_into_text(recorded, capsys, tiny_gguf):
    assert kvtrace(recorded, "diff", A, B, "--model", str(tiny_gguf), "--format", "json") == 0
    (fork,) = json.loads(capsys.readouterr().out)
    from kvtrace.patches.llama_cpp.repack import load_llama

    vocab = load_llama(tiny_gguf, vocab_only=True)
    assert fork["a"]["text"] == vocab.detokenize([41]).decode("utf-8", errors="replace")
    assert isinstance(fork["b"]["text"], str)
