"""Real clients of ``kvtrace run -- python -m llama_cpp.server``: the official ``openai`` package and
``kvtrace probe``.

Two stories against one traced server (the tiny F32 model; quantized ones need llama.cpp's weight
repack off, which ``llama_cpp.server`` cannot pass):

* An agent harness uses the ``openai`` client as it is, and tags its requests with W3C baggage in
  ``extra_headers``: chat and completions, streamed and not.  ``kvtrace runs`` lists the run with
  its episodes and the prompt tokens served from the cache.
* ``kvtrace probe`` sends each prompt cold (after a flush request), then warm twice.  Its
  requests carry ``traceparent`` and ``baggage``, so the engine records each one in the probe's
  run, as the child of the probe's own span in the same trace.  ``kvtrace runs`` counts each
  request once, and ``kvtrace diff --turns 0,2`` compares cold with warm from the engine's records.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace import semconv as sc
from kvtrace.cli import main

pytest.importorskip("llama_cpp.server.app")

VENV_BIN = Path(sys.executable).parent
STARTUP_S = 90
SPANS_S = 60
SERVER_ENV = {"KVTRACE_CAPTURE": "ids", "KVTRACE_HASH_KEY": "test-deployment-key"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    """One traced server for the module; it writes its spans to its own spool as it goes."""
    root = tmp_path_factory.mktemp("llama-server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRACE_")}
    env.update(SERVER_ENV, KVTRACE_SPOOL_DIR=str(root / "spool"), XDG_DATA_HOME=str(root / "data"))
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(VENV_BIN / "kvtrace"), "run", "--", sys.executable, "-m", "llama_cpp.server",
             "--model", str(tiny_gguf), "--host", "127.0.0.1", "--port", str(port),
             "--n_ctx", "512", "--n_batch", "64", "--n_ubatch", "64", "--n_threads", "1", "--n_threads_batch", "1",
             "--verbose", "false"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield {"url": base, "spool": root / "spool", "log": log_path}
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def ingest_run(db, spools, run_id: str, requests: int) -> None:
    """Ingest until ``requests`` request spans of ``run_id`` are stored (the server writes its spool as it goes)."""
    from kvtrace.collectors.ingest import ingest_paths

    deadline = time.monotonic() + SPANS_S
    while True:
        ingest_paths(db, [s for s in spools if s.exists()])
        stored = db.query("SELECT count() FROM kvtrace_requests WHERE run_id = {run:String}",
                          parameters={"run": run_id}).result_rows[0][0]
        if stored >= requests:
            assert stored == requests
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{stored} of {requests} request spans of run {run_id} arrived within {SPANS_S} s")
        time.sleep(0.2)


def kvtrace_json(capsys, *args) -> list[dict]:
    assert main(["-q", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- the official openai client ----------------------------------------------------------------------


def test_the_openai_client_tags_chat_and_completions_with_baggage(server, db, spool_dir, capsys):
    openai = pytest.importorskip("openai")
    run_id = "openai-harness"
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def tagged(episode: str, turn: int) -> dict[str, str]:
        return {"baggage": f"kvtrace.run_id={run_id},kvtrace.episode_id={episode},kvtrace.turn={turn}"}

    settings = dict(model=model, max_tokens=8, temperature=0.0)
    history = [{"role": "user", "content": "Describe the kitchen in detail"}]
    chat_0 = client.chat.completions.create(messages=history, extra_headers=tagged("chat", 0), **settings)
    history += [{"role": "assistant", "content": chat_0.choices[0].message.content},
                {"role": "user", "content": "And then what happened?"}]
    chat_1 = client.chat.completions.create(messages=history, stream=True, extra_headers=tagged("chat", 1), **settings)
    chat_1_text = "".join(chunk.choices[0].delta.content or "" for chunk in chat_1 if chunk.choices)
    story = "Once upon a time in a quiet village"
    story_0 = client.completions.create(prompt=story, extra_headers=tagged("story", 0), **settings)
    story_1 = client.completions.create(prompt=story + story_0.choices[0].text + " and then", stream=True,
                                        extra_headers=tagged("story", 1), **settings)
    story_1_text = "".join(chunk.choices[0].text for chunk in story_1 if chunk.choices)
    assert chat_1_text and story_1_text

    ingest_run(db, [server["spool"]], run_id, 4)
    rows = db.query(
        "SELECT episode_id, turn, operation, prompt_tokens, length(token_ids), length(margins), reused_tokens, "
        "cache_layer FROM kvtrace_requests WHERE run_id = {run:String} ORDER BY episode_id, turn",
        parameters={"run": run_id}).result_rows
    assert [(r[0], r[1], r[2]) for r in rows] == [("chat", 0, sc.OPERATION_CHAT), ("chat", 1, sc.OPERATION_CHAT),
                                                   ("story", 0, sc.OPERATION_TEXT_COMPLETION),
                                                   ("story", 1, sc.OPERATION_TEXT_COMPLETION)]
    by_turn = {(r[0], r[1]): r for r in rows}
    for key, response in ((("chat", 0), chat_0), (("story", 0), story_0)):  # what the client was told
        assert by_turn[key][3] == response.usage.prompt_tokens
        assert by_turn[key][4] == by_turn[key][5] == response.usage.completion_tokens
    for key in (("chat", 1), ("story", 1)):  # each second turn extends the first: its prefix stayed in the context
        assert by_turn[key][4] == by_turn[key][5] > 0
        assert by_turn[key][6] > 0 and by_turn[key][7] == sc.LAYER_KV_REUSE

    (run,) = [r for r in kvtrace_json(capsys, "runs") if r["run_id"] == run_id]
    assert (run["engine"], run["episodes"], run["requests"]) == ("llama_cpp", 2, 4)
    assert run["cached_prompt_tokens"] == sum(r[6] for r in rows) > 0
    assert run["output_tokens"] == sum(r[4] for r in rows)


# --- kvtrace probe, joined with the engine's spans ---------------------------------------------------


def test_probe_requests_join_the_engine_spans_and_diff_reads_them(server, db, spool_dir, tmp_path, capsys):
    run_id = "canary"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Describe the garden in detail"}]}) + "\n"
        + json.dumps({"id": "plain", "prompt": "Far away, beyond the hills, there lived"}) + "\n")
    code = main(["-q", "probe", "--url", f"{server['url']}/v1", "--prompts", str(prompts), "--run-id", run_id,
                 "--warm", "2", "--max-tokens", "6"])
    captured = capsys.readouterr()
    assert code == 0, captured.err

    # Per prompt: the probe's cold and two warm requests, the engine's record of each, and the flush.
    ingest_run(db, [server["spool"], spool_dir], run_id, 2 * (3 + 3 + 1))
    rows = db.query(
        "SELECT episode_id, turn, TraceId, SpanId, ParentSpanId, engine, reused_tokens_source != '' AS outside, "
        "reused_tokens, prompt_tokens, cache_layer FROM kvtrace_requests WHERE run_id = {run:String} "
        "ORDER BY episode_id, turn, outside DESC", parameters={"run": run_id}).result_rows
    flushes = [r for r in rows if r[0] == ""]
    assert len(flushes) == 2 and not any(r[6] for r in flushes)  # in the probe's run, in no episode
    probed = [r for r in rows if r[0] != ""]
    engine_side = {}
    for seen, engine in zip(probed[0::2], probed[1::2]):
        assert seen[6] and not engine[6]  # the probe's record, then the engine's
        assert (seen[0], seen[1]) == (engine[0], engine[1])
        assert engine[2] == seen[2] and engine[4] == seen[3]  # same trace; the probe's span is the parent
        assert engine[5] == "llama_cpp" and engine[8] == seen[8]
        engine_side[(engine[0], engine[1])] = engine
    assert sorted(engine_side) == [("chat", 0), ("chat", 1), ("chat", 2), ("plain", 0), ("plain", 1), ("plain", 2)]

    (run,) = [r for r in kvtrace_json(capsys, "runs") if r["run_id"] == run_id]
    assert (run["episodes"], run["requests"]) == (2, 2 * (3 + 1))  # each probed request once, plus the flushes

    assert main(["-q", "diff", run_id, run_id, "--turns", "0,2"]) == 0
    out = capsys.readouterr().out
    assert f"{run_id} turn 0 vs {run_id} turn 2:" in out and "of 2 episode(s) forked" in out
    for episode in ("chat", "plain"):  # the cache paths the engine saw, not the probe's assumptions
        cold, warm = engine_side[(episode, 0)], engine_side[(episode, 2)]
        assert 0 < warm[7] < warm[8] and warm[9] == sc.LAYER_KV_REUSE  # one prompt token replayed
        assert cold[7] < warm[7]
        assert f"{sc.LAYER_KV_REUSE}: reused {warm[7]} of {warm[8]} prompt tokens" in out
