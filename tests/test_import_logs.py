"""``kvtrace import``: request/response logs recorded by another harness become kvtrace runs.

Two agent runs were logged against an OpenAI-compatible server (token strings and top-2 logprobs,
no token ids, cached tokens in usage).  Imported, ``kvtrace diff`` finds exactly the forks one
gets by comparing the logged tokens directly; a malformed line is reported by number and the
rest is imported.
"""

from __future__ import annotations

import json
import math

import pytest

from kvtrace import semconv as sc
from kvtrace.cli import main

WORDS = ["The", " cat", " sat", " on", " the", " mat", ".", " It", " purred", " loudly"]


def chat_response(tokens: list[str], margins: list[float], cached: int) -> dict:
    content = []
    for token, margin in zip(tokens, margins):
        runner_up = WORDS[(WORDS.index(token) + 1) % len(WORDS)]
        content.append({"token": token, "logprob": -0.1, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": runner_up, "logprob": -0.1 - margin},
                                         {"token": token, "logprob": -0.1}]})
    return {"object": "chat.completion", "model": "served-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tokens)},
                         "logprobs": {"content": content}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": len(tokens),
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def episode_log(run: str, episode: str, turns: list[tuple[str, list[str]]]) -> list[dict]:
    lines, history = [], [{"role": "system", "content": "You are terse."}]
    for index, (user, tokens) in enumerate(turns):
        history = history + [{"role": "user", "content": user}]
        request = {"model": "served-model", "messages": history, "temperature": 0, "logprobs": True,
                   "top_logprobs": 2, "max_tokens": len(tokens)}
        lines.append({"episode_id": episode, "request_index": index, "request": request,
                      "response": chat_response(tokens, [0.5] * len(tokens), cached=30 if index else 0)})
        history = history + [{"role": "assistant", "content": "".join(tokens)}]
    return lines


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


A_TURNS = {
    "e0": [("hi", WORDS[:4]), ("more", WORDS[4:8]), ("end", WORDS[7:10])],
    "e1": [("hi", WORDS[:4]), ("more", WORDS[4:8]), ("end", WORDS[7:10])],
    "e2": [("hi", WORDS[:4]), ("more", WORDS[4:8])],
    "e3": [("go", WORDS[2:6])],
}
B_TURNS = {
    "e0": A_TURNS["e0"],                                                           # no fork
    "e1": [("hi", WORDS[:4]), ("more", WORDS[4:6] + [" purred", "."]), ("end", WORDS[7:10])],  # output, turn 1
    "e2": [("hi", WORDS[:4]), ("other", WORDS[4:8])],                              # prompt, turn 1
    "e3": [("go", [" mat"] + WORDS[3:6])],                                         # output, turn 0
}


def logged_fork(a: list[dict], b: list[dict]):
    """(turn, kind, position) of the first difference, straight from the logged requests and tokens."""
    for la, lb in zip(a, b):
        tokens = [[t["token"] for t in line["response"]["choices"][0]["logprobs"]["content"]] for line in (la, lb)]
        if la["request"]["messages"] != lb["request"]["messages"]:
            kind = "prompt"
        elif tokens[0] != tokens[1]:
            kind = "output"
        else:
            continue
        position = next((i for i, (x, y) in enumerate(zip(*tokens)) if x != y), min(map(len, tokens)))
        return la["request_index"], kind, (position if tokens[0] != tokens[1] else -1)
    return None


def test_imported_runs_fork_where_the_logged_tokens_differ(tmp_path, capsys):
    logs = {}
    for run, turns in (("agent-A", A_TURNS), ("agent-B", B_TURNS)):
        logs[run] = {e: episode_log(run, e, t) for e, t in turns.items()}
    lines_a = [line for e in logs["agent-A"].values() for line in e]
    lines_b = [line for e in logs["agent-B"].values() for line in e]
    lines_b.insert(2, "{not json")
    lines_b.insert(4, {"episode_id": "e9", "request_index": 0, "request": {"messages": []},
                       "response": {"choices": [{"message": {"content": "x"}}]}})
    path_a = write(tmp_path / "agent-A.jsonl", lines_a)
    path_b = write(tmp_path / "agent-B.jsonl", lines_b)

    assert main(["-q", "import", str(path_a), str(path_b), "--engine", "vllm"]) == 1
    err = capsys.readouterr().err
    assert f"{path_b}:3: not JSON" in err and f"{path_b}:5: response has no logprobs" in err
    assert f"imported {len(lines_a) + len(lines_b) - 2} request(s)" in err

    assert main(["-q", "diff", "agent-A", "agent-B", "--format", "json"]) == 0
    forks = {f["episode"]: (f["turn"], f["kind"], f["position"]) for f in json.loads(capsys.readouterr().out)}
    expected = {e: logged_fork(logs["agent-A"][e], logs["agent-B"][e]) for e in A_TURNS}
    assert forks == {e: fork for e, fork in expected.items() if fork is not None}
    assert set(forks) == {"e1", "e2", "e3"}


def test_imported_requests_carry_margins_and_cache_provenance(tmp_path, db, capsys):
    path = write(tmp_path / "run.jsonl", episode_log("run", "e0", A_TURNS["e0"]))
    assert main(["-q", "import", str(path), "--run-id", "imported", "--no-ingest"]) == 0
    from kvtrace.collectors.ingest import ingest_paths
    from kvtrace.config import default_spool_dir

    ingest_paths(db, [default_spool_dir()])
    rows = db.query("SELECT turn, reused_tokens, cache_layer, margins, SpanAttributes['kvtrace.output.token_id_source'] "
                    "FROM kvtrace_requests INNER JOIN otel_traces USING (SpanId) WHERE run_id = 'imported' "
                    "ORDER BY turn").result_rows
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, 0, sc.LAYER_NONE), (1, 30, sc.LAYER_KV_REUSE),
                                                 (2, 30, sc.LAYER_KV_REUSE)]
    assert all(m == pytest.approx(0.5) for m in rows[0][3]) and rows[0][4] == sc.TOKEN_ID_SOURCE_TEXT_HASH


def test_server_dialects_of_logprobs_and_cached_tokens():
    from kvtrace.exchanges.exchange import TextHasher, parse_exchange

    hasher = TextHasher(b"k")
    llama_server = {"choices": [{"logprobs": {"content": [
        {"id": 5, "token": "a", "logprob": -0.2, "top_logprobs": [{"id": 5, "token": "a", "logprob": -0.2},
                                                                   {"id": 9, "token": "b", "logprob": -1.7}]}]}}],
        "usage": {"prompt_tokens": 12}, "timings": {"cache_n": 11}}
    ex = parse_exchange({"messages": [{"role": "user", "content": "q"}]}, llama_server, hasher, None)
    assert (ex.token_ids, ex.top1_ids, ex.runner_up_ids) == ([5], [5], [9])
    assert ex.margins == [pytest.approx(1.5)] and ex.token_id_source == sc.TOKEN_ID_SOURCE_ENGINE
    assert (ex.cached_tokens, ex.cached_tokens_source) == (11, sc.REUSED_SOURCE_LLAMA_SERVER_TIMINGS)

    vllm_legacy = {"object": "text_completion", "choices": [{"logprobs": {
        "tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"token_id:7": -0.1, "token_id:3": -2.1}, {"token_id:4": -0.2, "token_id:8": -0.3}]}}],
        "usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}}
    ex = parse_exchange({"prompt": "p"}, vllm_legacy, hasher, None)
    assert (ex.token_ids, ex.top1_ids, ex.runner_up_ids) == ([7, 8], [7, 4], [3, 8])
    assert ex.margins == [pytest.approx(2.0), pytest.approx(0.1)]  # the chosen 8 was not the top-1 at position 1
    assert ex.operation == sc.OPERATION_TEXT_COMPLETION and ex.cached_tokens == 0

    lonely = {"choices": [{"logprobs": {"content": [{"token": "a", "logprob": 0.0, "top_logprobs": [
        {"token": "a", "logprob": 0.0}]}]}}]}
    ex = parse_exchange({"prompt": "p"}, lonely, hasher, None)
    assert ex.margins == [] and len(ex.token_ids) == 1 and not math.isnan(ex.logprobs[0])
    assert (ex.cached_tokens, ex.cached_tokens_source) == (None, sc.REUSED_SOURCE_UNKNOWN)


def test_generated_ids_the_logprobs_left_out_are_kept_and_the_per_token_arrays_stop_there():
    from kvtrace.exchanges.exchange import TextHasher, parse_exchange

    def entry(token_id: int) -> dict:
        top = [{"id": token_id, "logprob": -0.5}, {"id": 2, "logprob": -1.0}]
        return {"id": token_id, "token": "x", "logprob": -0.5, "top_logprobs": top}

    def read(reported: list[int], generated: list[int]):
        answer = {"choices": [{"logprobs": {"content": [entry(t) for t in reported]}, "token_ids": generated}]}
        return parse_exchange({"prompt": "p"}, answer, TextHasher(b"k"), None)

    # 198 (é's first byte) and 229, 133 (€'s first two) end inside a character: no logprobs for them.
    ex = read([272, 172, 175, 274], [272, 198, 172, 229, 133, 175, 274])
    assert ex.token_ids == [272, 198, 172, 229, 133, 175, 274] and ex.rows_cut_at == 1
    assert (ex.top1_ids, ex.runner_up_ids, ex.margins, ex.logprobs) == ([272], [2], [0.5], [-0.5])
    ex = read([272, 172], [272, 172, 198])  # the answer ended inside a character
    assert ex.token_ids == [272, 172, 198] and ex.rows_cut_at == 2 and len(ex.margins) == 2
    ex = read([272, 172], [272, 999, 5])  # not the same generation: the logprobs' ids stand alone
    assert ex.token_ids == [272, 172] and ex.rows_cut_at is None and len(ex.margins) == 2
