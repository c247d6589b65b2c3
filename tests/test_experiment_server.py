"""``kvtrace experiment --server``: the study's protocol against llama-server itself.

One command takes llama-server's command line, starts a fresh server for every pass with the arm's
configuration (cache off per request, prefix reuse in the slot, the host prompt cache with the
episodes interleaved), runs the seeded workload through kvtrace's proxy, and reports as the
in-process experiment does. On a generated quantized model the cache-on arms fork against the
cache-off arm, and `kvtrace diff` blames each fork on the cache.
"""

from __future__ import annotations

import json

import pytest

from kvtrace.cli import main
from llama_server_process import llama_server_binary

pytest.importorskip("h11")


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from kvtrace.testmodels.llama_gguf import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-Q8_0.gguf", "Q8_0", "tiny")


def test_the_protocol_against_llama_server_finds_forks_that_diff_blames_on_the_cache(tiny_q8, capsys):
    binary = llama_server_binary()
    command = f"{binary} -m {tiny_q8} -t 1 -tb 1 -b 64 -ub 64 --no-warmup --no-repack"
    code = main(["-q", "experiment", "--server", command, "--arms", "off,reuse,prompt-cache", "--episodes", "8",
                 "--turns", "4", "--tokens", "16", "--seed", "3", "--prefix", "srv", "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["formats"] == ["Q8_0"]
    pairs = {(p["arm_a"], p["arm_b"]): p for p in report["pairs"]}
    assert pairs[("reuse", "off")]["mean_cached_tokens"] > 0
    forked = {arm: pairs[(arm, "off")]["n_forked"] for arm in ("reuse", "prompt-cache")}
    assert sum(forked.values()) > 0, "this seed forks with the cache on the tiny Q8_0 model"

    for arm, count in forked.items():
        if not count:
            continue
        assert main(["-q", "diff", f"srv/Q8_0/{arm}/r0/canonical", "srv/Q8_0/off/r0/canonical",
                     "--format", "json"]) == 0
        forks = json.loads(capsys.readouterr().out)
        assert len(forks) == count
        for fork in forks:
            assert fork["attribution"] == "hit_vs_recompute", fork
            culprit = fork["culprit"]
            assert culprit["layer"] == ("prompt_cache" if arm == "prompt-cache" else "kv_reuse")
            if arm == "prompt-cache":
                # The slot held another episode: the state came back from the prompt cache, and the
                # server's log names the request of the same episode that stored it.
                assert culprit["event"] == "kvtrace.cache.restore"
                assert culprit["source"]["episode_id"] == fork["episode"]
                assert culprit["source"]["turn"] < fork["turn"]
