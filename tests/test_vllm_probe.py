"""``kvtrace probe`` against vLLM's own OpenAI server, which kvtrace's plugin traces from inside.

The story: an operator starts ``python -m vllm.entrypoints.openai.api_server`` with prefix caching
on and ``KVTRACE_ENABLED=1``; vLLM loads kvtrace's plugin by itself.  The probe sends each of two
prompts cold (with a fresh ``cache_salt``, so no stored block matches), then warm twice.  Every probe request carries
``traceparent`` and ``baggage``: the engine core records it in the probe's run, episode and turn,
as the child of the probe's span in the same trace.  The first warm request finds no unsalted
blocks and stores them; the second reuses them.  ``kvtrace diff canary canary --turns 0,2`` compares
the cold turn with the second warm one from the engine's records, and names the request whose
blocks were reused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from kvtrace import semconv as sc  # noqa: E402
from kvtrace.cli import main  # noqa: E402

RUN_ID = "canary"
MODEL_NAME = "tiny"
STARTUP_S = 240
SPANS_S = 60
PROMPTS = {  # long enough for several 32-token blocks, different from the first block on
    "agent": "the agent opens the file and reads the first line of the configuration " * 3 + "then it asks",
    "story": "once upon a time a quiet village kept a lantern burning by the old mill " * 3 + "and then",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    root = tmp_path_factory.mktemp("vllm-probe")
    model = make_model(root / "tiny-hf")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRACE_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               KVTRACE_SPOOL_DIR=str(root / "spool"), XDG_DATA_HOME=str(root / "data"), KVTRACE_CAPTURE="ids",
               KVTRACE_HASH_KEY="test-deployment-key", KVTRACE_ENABLED="1")
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        # No `kvtrace run`: vLLM loads kvtrace's plugin (entry point vllm.general_plugins) in every process,
        # which records because KVTRACE_ENABLED=1 opted the server in.
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max-model-len", "256", "--block-size", "32", "--enforce-eager",
             "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0", "--shutdown-timeout", "30"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # never leave the engine core behind
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        if process.poll() is None:
            process.wait(timeout=30)

    base = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not become healthy:\n{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield {"url": base, "spool": root / "spool", "log": log_path}
    finally:
        stop()


@pytest.mark.slow
def test_probe_requests_join_the_engine_core_spans_and_diff_names_the_stored_blocks(server, db, spool_dir,
                                                                                     tmp_path, capsys):
    from kvtrace.collectors.ingest import ingest_paths

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": key, "prompt": text}) + "\n" for key, text in PROMPTS.items()))
    code = main(["-q", "probe", "--url", f"{server['url']}/v1", "--prompts", str(prompts), "--run-id", RUN_ID,
                 "--warm", "2", "--max-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "probing" in captured.err and "as vllm" in captured.err

    expected = len(PROMPTS) * 3 * 2  # cold and two warm requests, each recorded by the probe and the engine
    deadline = time.monotonic() + SPANS_S
    while True:
        ingest_paths(db, [p for p in (server["spool"], spool_dir) if p.exists()])
        rows = db.query(
            "SELECT episode_id, turn, TraceId, SpanId, ParentSpanId, engine, reused_tokens_source != '' AS outside, "
            "reused_tokens, prompt_tokens, cache_layer, source_episode_id, source_turn, length(margins) "
            "FROM kvtrace_requests WHERE run_id = {run:String} ORDER BY episode_id, turn, outside DESC",
            parameters={"run": RUN_ID}).result_rows
        if len(rows) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(rows) == expected, server["log"].read_text(errors="replace")[-3000:]

    engine_side = {}
    for seen, engine in zip(rows[0::2], rows[1::2]):
        assert seen[6] and not engine[6]  # the probe's record, then the engine core's
        assert (seen[0], seen[1]) == (engine[0], engine[1])
        assert engine[2] == seen[2] and engine[4] == seen[3]  # same trace; the probe's span is the parent
        assert engine[5] == "vllm" and engine[8] == seen[8] and engine[12] == 8
        engine_side[(engine[0], engine[1])] = engine
    for episode in PROMPTS:
        cold, first_warm, second_warm = (engine_side[(episode, turn)] for turn in (0, 1, 2))
        assert cold[7] == 0 and first_warm[7] == 0  # salted blocks match nothing unsalted; nothing stored yet
        assert second_warm[7] > 0 and second_warm[7] % 32 == 0 and second_warm[9] == sc.LAYER_PREFIX_BLOCKS
        assert (second_warm[10], second_warm[11]) == (episode, 1)  # the blocks the first warm request stored

    (run,) = [r for r in json.loads(run_json(capsys)) if r["run_id"] == RUN_ID]
    assert (run["episodes"], run["requests"]) == (len(PROMPTS), len(PROMPTS) * 3)  # each request once

    assert main(["-q", "diff", RUN_ID, RUN_ID, "--turns", "0,2"]) == 0
    out = capsys.readouterr().out
    assert f"{RUN_ID} turn 0 vs {RUN_ID} turn 2:" in out and f"of {len(PROMPTS)} episode(s) forked" in out
    for episode in PROMPTS:
        warm = engine_side[(episode, 2)]
        assert (f"{sc.LAYER_PREFIX_BLOCKS}: reused {warm[7]} of {warm[8]} prompt tokens, "
                f"state from episode {episode} turn 1") in out


def run_json(capsys) -> str:
    assert main(["-q", "runs", "--format", "json"]) == 0
    return capsys.readouterr().out
