"""``kvtrace experiment --server``: the study's protocol against llama-server itself.

One command takes llama-server's command line, starts a fresh server for every pass with the arm's
configuration (cache off per request, prefix reuse in the slot, the host prompt cache with the
episodes interleaved), runs the seeded workload through kvtrace's proxy, and reports as the
in-process experiment does. On a generated quantized model the cache-on arms fork against the
cache-off arm, and `kvtrace diff` blames each fork on the cache.
"""

from __future__ import annotations

import json
import os

import pytest

from kvtrace.cli import main
from kvtrace.db import connect
from llama_server_process import free_port, llama_server_binary

pytest.importorskip("h11")


def db_rows(sql: str) -> list[tuple]:
    """Rows from the database the commands used (opened after them: chDB is one process's at a time)."""
    client = connect(os.environ["KVTRACE_CLICKHOUSE_URL"])
    try:
        return client.query(sql).result_rows
    finally:
        client.close()


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from kvtrace.testmodels.llama_gguf import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-Q8_0.gguf", "Q8_0", "tiny")


def test_the_protocol_against_llama_server_finds_forks_that_diff_blames_on_the_cache(tiny_q8, capsys):
    binary = llama_server_binary()
    code = main(["-q", "experiment", "--server", f"{binary} -m {tiny_q8} --no-warmup --no-repack",
                 "--arms", "off,reuse,prompt-cache", "--episodes", "8", "--turns", "4", "--tokens", "16",
                 "--seed", "3", "--prefix", "srv", "--n-batch", "64", "--n-ubatch", "64", "--flash-attn", "on",
                 "--cache-ram", "64MiB", "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["formats"] == ["Q8_0"]
    # The server's own log gave the settings the spans carry: they match the pass's run id.
    assert {p["settings"] for p in report["pairs"]} == {"b64.ub64.fa-on.kv-f16"}
    pairs = {p["arm"]: p for p in report["pairs"] if p["arm_b"] == "off"}
    assert pairs["reuse"]["mean_cached_tokens"] > 0 and pairs["prompt-cache"]["arm_a"] == "prompt-cache-64MiB"
    assert sum(p["n_forked"] for p in pairs.values()) > 0, "this seed forks with the cache on the tiny Q8_0 model"

    runs = {r["arm"]: r["run_id"] for r in report["runs"]}
    for arm, pair in pairs.items():
        if not pair["n_forked"]:
            continue
        assert main(["-q", "diff", runs[arm], runs["off"], "--format", "json"]) == 0
        forks = json.loads(capsys.readouterr().out)
        assert len(forks) == pair["n_forked"]
        for fork in forks:
            assert fork["attribution"] == "hit_vs_recompute", fork
            culprit = fork["culprit"]
            if culprit["layer"] == "prompt_cache":
                # The state came back from the prompt cache, and the server's log names the request of
                # the same episode that stored it.
                assert arm == "prompt-cache" and culprit["event"] == "kvtrace.cache.restore"
                assert culprit["source"]["episode_id"] == fork["episode"]
                assert culprit["source"]["turn"] < fork["turn"]
            else:
                # The slot's own state: llama-server keeps the slot when the new prompt shares enough
                # with it (here the episodes' common opening), with or without its prompt cache.
                assert culprit["layer"] == "kv_reuse" and culprit["event"] == "kvtrace.cache.reuse"

    # With the episodes interleaved, later turns come back from the prompt cache, each naming the
    # request of the same episode whose state the server restored.
    restored = db_rows(f"SELECT episode_id, turn, source_episode_id, source_turn FROM kvtrace_requests "
                       f"WHERE run_id = '{runs['prompt-cache']}' AND cache_layer = 'prompt_cache'")
    assert restored and all(r[0] == r[2] and r[3] < r[1] for r in restored)


def run_refused(arguments: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(["-q", "experiment", *arguments])
    except SystemExit as exc:  # argparse refuses the value while parsing
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("arguments, message", [
    (["--arms", "off,reuse,prompt-cache"], "a running server (--server URL) has one prompt-cache setting"),
    (["--conversation", "tokens"], "--server keeps the conversation as text"),
    (["--cache-ram", "100000"], "llama-server's --cache-ram is in MiB"),
    (["--engine", "vllm"], "--server runs against llama-server; leave out --engine"),
], ids=["both-cache-arms", "tokens", "cache-bytes", "vllm"])
def test_a_plan_no_server_can_run_is_refused_in_one_line_before_the_server_is_asked(arguments, message, capsys,
                                                                                    kvtrace_env):
    # Nothing listens on the port: a refusal that waited for the server would say so instead.
    code, err = run_refused(["--server", f"http://127.0.0.1:{free_port()}", *arguments], capsys)
    assert code == 2 and message in err
    assert not (kvtrace_env / "spool").exists()


def test_a_running_server_is_asked_for_off_and_reuse_when_no_arms_are_given(capsys, kvtrace_env):
    # The default arms pass the plan check (both cache arms would not), so the server is asked next.
    url = f"http://127.0.0.1:{free_port()}"
    code, err = run_refused(["--server", url], capsys)
    assert code == 1 and f"{url}/props did not answer: is it llama-server?" in err
