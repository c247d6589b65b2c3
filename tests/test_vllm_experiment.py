"""`kvtrace experiment --engine vllm`: the multi-turn tool-use experiment on vLLM's offline API.

The story: a researcher runs the experiment on the ``fork`` test model in bf16, with the arms
``off`` (prefix cache reset before every request) and ``prefix`` (automatic prefix caching), each
twice. The command exits 0 and reports, for ``prefix`` against ``off``, a divergence rate with its
95 % interval; the reruns of ``off`` are bit-identical (token ids, margins, logprobs); ``off``
recomputed every prompt while ``prefix`` reused earlier turns' blocks; and every fork the report
counts is blamed on a cache event: for a hit against a recompute, the hit, with vLLM's block hashes
and the earlier request of the same run that stored them.

The workload is small (5 episodes x 2 turns x 12 tokens) to keep CI short: forks are rare at that
size (tests/test_vllm_forks.py is where forks are made to appear), so the attribution assertions
hold for whatever forks appear. The command runs once per module, in its own process, as a user
would run it; each pass starts its own vLLM engine (kvtrace comes in through vLLM's plugin).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtrace import semconv as sc  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402
from kvtrace.db import connect  # noqa: E402

pytestmark = pytest.mark.timeout(900)
"""Four passes, each starting vLLM: about a minute and a half alone, many minutes on a busy shared machine."""

PREFIX = "vexp"
EPISODES, TURNS, TOKENS = 5, 2, 12
DTYPE = "bfloat16"
CACHE_LABELS = {sc.ATTRIBUTION_HIT_VS_RECOMPUTE, sc.ATTRIBUTION_REUSE_LENGTH, sc.ATTRIBUTION_CACHE_SOURCE}


def run_id(arm: str, repeat: int) -> str:
    return f"{PREFIX}/{DTYPE}/eager/{arm}/r{repeat}/canonical"


def kvtrace_cli(home: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRACE_")}
    env.update(XDG_DATA_HOME=str(home / "data"), KVTRACE_SPOOL_DIR=str(home / "spool"),
               KVTRACE_CLICKHOUSE_URL=f"chdb://{home / 'db'}", KVTRACE_CAPTURE="ids",
               KVTRACE_HASH_KEY="test-deployment-key")
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """The experiment's JSON report, and its database's path."""
    home = tmp_path_factory.mktemp("vllm-experiment")
    done = kvtrace_cli(home, "experiment", "--engine", "vllm", "--generate", "fork", "--dtype", "bf16",
                       "--episodes", str(EPISODES), "--turns", str(TURNS), "--tokens", str(TOKENS), "--repeats", "2",
                       "--prefix", PREFIX, "--format", "json", timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), home / "db"


@pytest.fixture
def recorded(experiment):
    client = connect(f"chdb://{experiment[1]}")
    yield client
    client.close()


def requests_of(client, run: str) -> dict[tuple[str, int], dict]:
    result = client.query("SELECT episode_id, turn, token_ids, margins, logprobs, reused_tokens, cache_layer "
                          "FROM kvtrace_requests WHERE run_id = {run:String}", parameters={"run": run})
    return {(r[0], r[1]): {"tokens": list(r[2]), "margins": list(r[3]), "logprobs": list(r[4]), "reused": r[5],
                           "layer": r[6]} for r in result.result_rows}


@pytest.mark.slow
def test_the_report_gives_prefix_against_off_a_rate_with_its_interval(experiment):
    report, _ = experiment
    assert (report["engine"], report["formats"], report["arms"]) == ("vllm", [DTYPE], ["off", "prefix"])
    assert [r["run_id"] for r in report["runs"]] == [run_id("off", 0), run_id("prefix", 0), run_id("off", 1),
                                                     run_id("prefix", 1)]
    (pair,) = report["pairs"]
    assert (pair["format"], pair["settings"], pair["arm_a"], pair["arm_b"]) == (DTYPE, "eager", "prefix", "off")
    assert pair["n_episodes"] == EPISODES and 0 <= pair["n_forked"] <= EPISODES
    low, high = pair["ci95"]
    assert 0 <= low <= pair["rate"] <= high <= 1 and high > low
    assert pair["rate"] == pytest.approx(pair["n_forked"] / EPISODES)
    assert pair["mean_cached_tokens"] > 0  # the prefix arm reused blocks
    assert report["requests"] == 4 * EPISODES * TURNS


@pytest.mark.slow
def test_off_reruns_are_bit_identical(experiment, recorded):
    report, _ = experiment
    repeats = {p["arm"]: p for p in report["repeat_agreement"]}
    assert (repeats["off"]["runs"], repeats["off"]["n_episodes"], repeats["off"]["n_forked"]) == (2, EPISODES, 0)
    first, again = requests_of(recorded, run_id("off", 0)), requests_of(recorded, run_id("off", 1))
    assert len(first) == EPISODES * TURNS and first == again  # ids, margins and logprobs, request by request


@pytest.mark.slow
def test_off_recomputes_every_prompt_and_prefix_reuses_earlier_turns(recorded):
    off, prefix = requests_of(recorded, run_id("off", 0)), requests_of(recorded, run_id("prefix", 0))
    assert {r["reused"] for r in off.values()} == {0}
    later = [r for (_, turn), r in prefix.items() if turn > 0]
    assert later and all(r["reused"] > 0 and r["layer"] == sc.LAYER_PREFIX_BLOCKS for r in later)


@pytest.mark.slow
def test_every_fork_is_blamed_on_a_cache_event(experiment, recorded):
    report, _ = experiment
    for found in report["attribution"].values():
        assert set(found["labels"]) <= CACHE_LABELS
    (pair,) = report["pairs"]
    for repeat in (0, 1):
        prefix_run = run_id("prefix", repeat)
        requests_stored = {r[0] for r in recorded.query(
            "SELECT request_id FROM kvtrace_requests WHERE run_id = {run:String}",
            parameters={"run": prefix_run}).result_rows}
        diff = diff_runs(recorded, run_id("off", repeat), prefix_run)
        assert diff.episodes_compared == EPISODES
        if pair["samples"] == EPISODES:  # the repeats agreed: each repeat forks the episodes the report counts
            assert len(diff.forks) == pair["n_forked"]
        for fork in diff.forks:
            assert fork.attribution in CACHE_LABELS
            if fork.attribution == sc.ATTRIBUTION_HIT_VS_RECOMPUTE:
                culprit = fork.culprit
                assert culprit.run == prefix_run and culprit.event == sc.EVENT_CACHE_LOOKUP
                assert culprit.reused_tokens == fork.b.cache.reused_tokens > 0
                assert len(culprit.block_hashes) * 32 == culprit.reused_tokens  # vLLM's 32-token blocks
                # ... stored by an earlier request of the same run
                assert culprit.source.run_id == prefix_run and culprit.source.request_id in requests_stored
        print(f"\nrepeat {repeat}: {len(diff.forks)} of {EPISODES} episodes forked: "
              + ", ".join(f"{f.episode} turn {f.turn} token {f.position} [{f.attribution}]" for f in diff.forks))


def test_llama_only_options_are_refused_with_the_engine_vllm(tmp_path):
    done = kvtrace_cli(tmp_path, "experiment", "--engine", "vllm", "--generate", "fork", "--n-batch", "64")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kvtrace: error: --n-batch sets llama.cpp only; with --engine vllm leave it out (the dtypes are --dtype)"]
    done = kvtrace_cli(tmp_path, "experiment", "--engine", "vllm", "--generate", "fork", "--dtype", "int3")
    assert done.returncode == 2 and done.stderr.strip() == "kvtrace: error: --dtype int3: choose from bf16, fp16, fp32"


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """`--batch 1,turn` on the off arm: one request at a time, then each turn's requests together."""
    home = tmp_path_factory.mktemp("vllm-batch")
    done = kvtrace_cli(home, "experiment", "--engine", "vllm", "--generate", "fork", "--dtype", "bf16", "--arms", "off",
                       "--batch", "1,turn", "--episodes", str(EPISODES), "--turns", str(TURNS), "--tokens", str(TOKENS),
                       "--prefix", "vbatch", "--format", "json", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    client = connect(f"chdb://{home / 'db'}")
    yield json.loads(done.stdout), client
    client.close()


@pytest.mark.slow
def test_a_turn_batched_together_is_compared_with_one_request_at_a_time(batched):
    report, client = batched
    alone, together = f"vbatch/{DTYPE}/eager/off/r0/canonical", f"vbatch/{DTYPE}/eager.batch-{EPISODES}/off/r0/canonical"
    assert [r["run_id"] for r in report["runs"]] == [alone, together]
    assert report["engine_settings"] == ["eager", f"eager.batch-{EPISODES}"]
    (effect,) = report["batching"]
    assert (effect["run_id"], effect["compared_with"], effect["batch"], effect["n_episodes"]) == (
        together, alone, EPISODES, EPISODES)
    assert effect["n_forked"] == sum(effect["labels"].values())
    # Both runs recompute every prompt: a fork between them is the batching's, and says so.
    assert set(effect["labels"]) <= {sc.ATTRIBUTION_BATCH_COMPOSITION}
    # The engine's own steps: alone, one row; together, turn 0's first token computed beside every episode's.
    rows = {run: client.query("SELECT turn, step_rows, prefill_steps, prompt_tokens FROM kvtrace_requests FINAL "
                              "WHERE run_id = {run:String}", parameters={"run": run}).result_rows
            for run in (alone, together)}
    assert all(set(step_rows) == {1} for _, step_rows, _, _ in rows[alone])
    assert all(sum(split) == prompt for _, _, split, prompt in rows[alone] + rows[together])
    assert [step_rows[0] for turn, step_rows, _, _ in rows[together] if turn == 0] == [EPISODES] * EPISODES
    print(f"\nbatched against alone: {effect['n_forked']} of {EPISODES} episodes forked: {effect['labels']}")
