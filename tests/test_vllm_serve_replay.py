"""`kvtrace replay` on a conversation recorded through vLLM's OpenAI server, token for token.

The story: an agent talks to ``kvtrace run -- vllm serve MODEL --enable-prefix-caching`` over
``/v1/chat/completions``, greedy, each request tagged with W3C baggage (run, episode, turn), with
KVTRACE_CAPTURE=ids. Every turn resends the conversation so far, so each turn after the first finds
the blocks the previous turn stored. The server is stopped, its spool ingested, and `kvtrace replay
RUN --episode E` re-executes the conversation in vLLM's offline ``LLM``: the chat template was
applied by the server, and the record holds the prompt ids it made; the engine starts with the
settings the server's engine core recorded; the model directory is found in kvtrace's model cache
by its fingerprint (the record names the served name, not a path). vLLM finds the recorded number of
cached tokens for every turn and generates every recorded token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from kvtrace import semconv as sc  # noqa: E402
from kvtrace.db import connect  # noqa: E402
from vllm_server_process import MODEL_NAME, running_vllm_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
"""A server start and a replay's engine start: minutes on a busy machine."""

RUN_ID, EPISODE, TURNS, TOKENS = "served-chat", "e0", 3, 8
SYSTEM = "You are the agent. Open the file, read the first line of the configuration and report it. " * 2


def chat(base: str, messages: list[dict], turn: int) -> dict:
    headers = {"baggage": f"kvtrace.run_id={RUN_ID},kvtrace.episode_id={EPISODE},kvtrace.turn={turn}"}
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": TOKENS, "temperature": 0.0}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, f"turn {turn}: {response.text[:2000]}"
    return response.json()


@pytest.mark.slow
def test_a_chat_recorded_through_vllm_serve_replays_token_for_token_on_its_block_reuse(kvtrace_env, spool_dir):
    from kvtrace.collectors.ingest import ingest_paths
    from kvtrace.collectors.schema import init_schema
    from kvtrace.experiment.models import model_cache_dir
    from kvtrace.testmodels.hf_llama import make_model

    model = make_model(model_cache_dir() / "served-tiny-hf")
    messages = [{"role": "system", "content": SYSTEM}]
    # A context longer than the helper's 256: the conversation grows by whole turns (the replay's own is
    # what its requests need; a context length is not a numerics setting).
    with running_vllm_server(model, spool_dir, kvtrace_env / "server.log", "--max-model-len", "1024") as (base, stop):
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Step {turn}: what does line {turn} say?"})
            answer = chat(base, messages, turn)
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        stop()

    client = connect(os.environ["KVTRACE_CLICKHOUSE_URL"])
    try:  # closed before the replay: it opens the embedded database itself
        init_schema(client)
        ingest_paths(client, [spool_dir])
        rows = client.query(
            "SELECT turn, reused_tokens, cache_layer, length(token_ids), model FROM kvtrace_requests FINAL "
            "WHERE run_id = {run:String} ORDER BY turn", parameters={"run": RUN_ID}).result_rows
    finally:
        client.close()
    assert [r[0] for r in rows] == list(range(TURNS)) and {r[4] for r in rows} == {MODEL_NAME}, rows
    assert rows[0][1] == 0 and all(r[1] > 0 and r[2] == sc.LAYER_PREFIX_BLOCKS for r in rows[1:]), rows
    recorded_tokens = sum(r[3] for r in rows)

    done = subprocess.run([sys.executable, "-m", "kvtrace.cli", "replay", "-q", RUN_ID, "--episode", EPISODE,
                           "--format", "json"], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["exact"] and result["requests"] == result["requests_reproduced"] == TURNS, result
    assert result["tokens"] == result["tokens_reproduced"] == recorded_tokens and result["dependencies"] == 0
    paths = {r["turn"]: r for r in result["per_request"]}
    assert paths[0]["path"] == "recompute"
    for turn, reused, *_ in rows[1:]:  # vLLM found exactly the recorded number of cached tokens
        assert paths[turn]["path"] == f"prefix-block reuse of {reused} tokens" and paths[turn]["path_reproduced"]
