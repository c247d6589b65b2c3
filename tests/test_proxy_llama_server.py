"""``kvtrace proxy`` in front of a real llama-server (llama.cpp's own C++ server).

The story: an operator runs llama-server, which kvtrace cannot patch, and puts the proxy in
front of it. Clients change nothing but the address. A client that asks for no logprobs gets
exactly what the server would have sent it — the proxy asked the server for the top two
alternatives per token and took them out again — and every request becomes a span with one
margin per generated token, the cache counts the server reported and the slot that served it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from integrity_readback import assert_counted_and_alerted, store
from kvtrace import queries, semconv as sc
from kvtrace.recording.counters import SpanCounters
from llama_server_process import (SIZING, free_port, llama_server_binary, proxy_process, running_llama_server,
                                  running_proxy, same_bytes, sse_payloads, started_llama_server)
from readme_commands import readme_command

pytest.importorskip("h11")

CHAT = {"messages": [{"role": "user", "content": "Describe the kitchen in detail"}], "max_tokens": 12,
        "temperature": 0}
COMPLETION = {"prompt": "Once upon a time in a quiet village", "max_tokens": 12, "temperature": 0}
NATIVE = {"prompt": "The harbour at dawn was", "n_predict": 12, "temperature": 0}
CASES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/completion", NATIVE)]

SERVE = "llama-server -m MODEL.gguf --port 8080 --no-repack -lv 4 --log-file server.log"
PROXY = "kvtrace proxy --upstream http://127.0.0.1:8080 --llama-server-log server.log"
PER_CALL = ("id", "created", "timings")
"""Fields that differ between any two calls of the same request (ids, clocks)."""


def same_call(document):
    """A document without its per-call fields, as an order-sensitive string (the server's key order counts)."""
    if isinstance(document, dict):
        return json.dumps({k: same_call(v) for k, v in document.items() if k not in PER_CALL}, ensure_ascii=False)
    if isinstance(document, list):
        return json.dumps([same_call(v) for v in document], ensure_ascii=False)
    return json.dumps(document, ensure_ascii=False)


def margins_asked_directly(server: str, path: str, body: dict) -> tuple[list[int], list[float]]:
    """Token ids and top-1 − top-2 margins the server reports when asked for the top two itself."""
    asked = {**body, "n_probs": 2} if path == "/completion" else (
        {**body, "logprobs": True, "top_logprobs": 2} if "messages" in body else {**body, "logprobs": 2})
    answer = httpx.post(server + path, json=asked, timeout=120).json()
    positions = answer["completion_probabilities"] if path == "/completion" else answer["choices"][0]["logprobs"]["content"]
    return ([p["id"] for p in positions],
            [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in positions])


@pytest.fixture(scope="module")
def llama_server(tiny_gguf, tmp_path_factory):
    llama_server_binary()
    with running_llama_server(tiny_gguf, log_path=tmp_path_factory.mktemp("llama-server") / "server.log") as base:
        yield base


def test_a_client_without_logprobs_gets_the_servers_own_answer_and_the_span_gets_every_margin(
        llama_server, memory_recorder, finished_requests):
    with running_proxy(llama_server, memory_recorder) as proxy:
        for path, body in CASES:
            # Every request recomputes its prompt, so the direct and the proxied call see the same state.
            body = {**body, "cache_prompt": False}
            direct = httpx.post(llama_server + path, json=body, timeout=120)
            proxied = httpx.post(proxy + path, json=body, timeout=120)
            assert proxied.status_code == direct.status_code == 200
            assert same_bytes(proxied.content) == same_bytes(direct.content), path
            assert "completion_probabilities" not in proxied.json()

    spans = finished_requests(memory_recorder)
    assert len(spans) == len(CASES)
    for (path, body), (attributes, _, _) in zip(CASES, spans):
        ids, margins = margins_asked_directly(llama_server, path, {**body, "cache_prompt": False})
        assert len(ids) == 12
        assert list(attributes[sc.OUTPUT_TOKEN_IDS]) == ids, path
        assert list(attributes[sc.OUTPUT_MARGINS]) == margins, path
        assert attributes[sc.OUTPUT_TOKEN_ID_SOURCE] == sc.TOKEN_ID_SOURCE_ENGINE
        assert attributes[sc.MARGIN_SOURCE] == sc.MARGIN_SOURCE_INJECTED
        assert attributes[sc.MARGIN_UNIT] == sc.MARGIN_UNIT_RAW_LOGIT
        assert attributes[sc.ENGINE_NAME] == "llama-server" and attributes[sc.ENGINE_VERSION]
        assert attributes[sc.SERVER_SLOT_ID] == 0  # one slot
        assert attributes[sc.CACHE_REUSED_TOKENS] == 0
        assert attributes[sc.CACHE_RECOMPUTED_TOKENS] == attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] > 0


def test_streamed_answers_carry_the_same_chunks_and_the_span_gets_every_margin(
        llama_server, memory_recorder, finished_requests):
    with running_proxy(llama_server, memory_recorder) as proxy:
        for path, body in CASES:
            body = {**body, "cache_prompt": False, "stream": True}
            direct = httpx.post(llama_server + path, json=body, timeout=120)
            proxied = httpx.post(proxy + path, json=body, timeout=120)
            assert proxied.headers["content-type"].startswith("text/event-stream")
            chunks, direct_chunks = sse_payloads(proxied.content), sse_payloads(direct.content)
            assert len(chunks) == len(direct_chunks) > 12
            assert [same_call(c) for c in chunks] == [same_call(c) for c in direct_chunks], path
            assert same_bytes(proxied.content) == same_bytes(direct.content), path

    for (path, body), (attributes, _, _) in zip(CASES, finished_requests(memory_recorder)):
        ids, margins = margins_asked_directly(llama_server, path, {**body, "cache_prompt": False})
        assert list(attributes[sc.OUTPUT_TOKEN_IDS]) == ids, path
        assert list(attributes[sc.OUTPUT_MARGINS]) == margins, path
        assert attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] > 0


def test_a_client_that_asks_for_logprobs_gets_them_untouched_and_they_give_the_margins(
        llama_server, memory_recorder, finished_requests):
    body = {**CHAT, "cache_prompt": False, "logprobs": True, "top_logprobs": 3}
    with running_proxy(llama_server, memory_recorder) as proxy:
        direct = httpx.post(llama_server + "/v1/chat/completions", json=body, timeout=120).json()
        proxied = httpx.post(proxy + "/v1/chat/completions", json=body, timeout=120).json()
    assert same_call(proxied) == same_call(direct)
    positions = proxied["choices"][0]["logprobs"]["content"]
    assert all(len(p["top_logprobs"]) == 3 for p in positions)
    (attributes, _, _), = finished_requests(memory_recorder)
    assert attributes[sc.MARGIN_SOURCE] == sc.MARGIN_SOURCE_CLIENT
    assert list(attributes[sc.OUTPUT_MARGINS]) == [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"]
                                                   for p in positions]


SPLIT_CHARACTERS = 'root ::= "ab" "\u00e9\u20ac" "cd"'
"""A grammar whose answer spells é and € in byte tokens (the tiny model's vocabulary has neither): the tokens
before each character's last byte end inside it, and llama-server's logprobs leave them out."""


def test_a_token_that_ends_inside_a_utf8_character_keeps_its_id_and_the_client_its_answer(
        llama_server, memory_recorder, finished_requests):
    body = {**NATIVE, "grammar": SPLIT_CHARACTERS, "cache_prompt": False}
    generated = httpx.post(llama_server + "/completion", json={**body, "return_tokens": True}, timeout=120).json()
    ids, margins = margins_asked_directly(llama_server, "/completion", body)
    assert len(ids) < len(generated["tokens"])  # what the probabilities leave out
    unreported = next(i for i, (a, b) in enumerate(zip(ids, generated["tokens"])) if a != b)
    with running_proxy(llama_server, memory_recorder) as proxy:
        direct = httpx.post(llama_server + "/completion", json=body, timeout=120)
        proxied = httpx.post(proxy + "/completion", json=body, timeout=120)
    assert same_bytes(proxied.content) == same_bytes(direct.content)  # "tokens": [], as the server's own
    (attributes, _, _), = finished_requests(memory_recorder)
    assert list(attributes[sc.OUTPUT_TOKEN_IDS]) == generated["tokens"]
    assert attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == generated["tokens_predicted"]
    assert (attributes[sc.OUTPUT_ROWS_CUT_AT], attributes[sc.OUTPUT_ROWS_CUT_REASON]) == (
        unreported, sc.ROWS_UNREPORTED)
    assert list(attributes[sc.OUTPUT_MARGINS]) == margins[:unreported]


def test_the_span_says_whether_the_prompt_was_recomputed_or_reused(llama_server, memory_recorder, finished_requests):
    conversation = {"messages": [{"role": "user", "content": "List the tools in the shed, one per line"}],
                    "max_tokens": 6, "temperature": 0}
    with running_proxy(llama_server, memory_recorder) as proxy:
        for cache_prompt in (False, True, True):
            answer = httpx.post(proxy + "/v1/chat/completions", json={**conversation, "cache_prompt": cache_prompt},
                                timeout=120).json()
            assert answer["choices"][0]["message"]["content"]
    bypassed, first, again = (attributes for attributes, _, _ in finished_requests(memory_recorder))
    prompt_tokens = bypassed[sc.GEN_AI_USAGE_INPUT_TOKENS]
    assert json.loads(bypassed[sc.CACHE_SETTINGS])["cache_prompt"] is False
    assert (bypassed[sc.CACHE_REUSED_TOKENS], bypassed[sc.CACHE_RECOMPUTED_TOKENS]) == (0, prompt_tokens)
    assert bypassed[sc.CACHE_LAYER] == sc.LAYER_NONE
    # The server kept the slot's state of the request before: the same prompt is served from it.
    assert 0 < again[sc.CACHE_REUSED_TOKENS] <= prompt_tokens
    assert again[sc.CACHE_REUSED_TOKENS] + again[sc.CACHE_RECOMPUTED_TOKENS] == prompt_tokens
    assert again[sc.CACHE_LAYER] == sc.LAYER_KV_REUSE
    assert again[sc.CACHE_REUSED_TOKENS_SOURCE] == sc.REUSED_SOURCE_OPENAI_USAGE
    assert first[sc.PROMPT_HASH] == again[sc.PROMPT_HASH] == bypassed[sc.PROMPT_HASH]


def test_correlation_comes_from_the_clients_trace_context(llama_server, memory_recorder, finished_requests):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01",
               "baggage": "kvtrace.run_id=night-shift,kvtrace.episode_id=ep-7,kvtrace.turn=3"}
    with running_proxy(llama_server, memory_recorder) as proxy:
        httpx.post(proxy + "/completion", json={**NATIVE, "n_predict": 3}, headers=headers, timeout=120)
    (attributes, _, span), = finished_requests(memory_recorder)
    assert (attributes[sc.RUN_ID], attributes[sc.EPISODE_ID], attributes[sc.TURN]) == ("night-shift", "ep-7", 3)
    assert "%032x" % span.context.trace_id == trace_id
    assert "%016x" % span.parent.span_id == parent_id


def test_an_upstream_error_reaches_the_client_unchanged_and_is_recorded(llama_server, memory_recorder,
                                                                        finished_requests):
    bad = {"messages": "not a list", "max_tokens": 3}
    with running_proxy(llama_server, memory_recorder) as proxy:
        direct = httpx.post(llama_server + "/v1/chat/completions", json=bad, timeout=60)
        proxied = httpx.post(proxy + "/v1/chat/completions", json=bad, timeout=60)
    assert proxied.status_code == direct.status_code >= 400
    assert proxied.content == direct.content
    (attributes, _, span), = finished_requests(memory_recorder)
    assert attributes[sc.HTTP_RESPONSE_STATUS_CODE] == direct.status_code
    assert span.status.status_code.name == "ERROR"
    assert str(direct.status_code) in span.status.description


def test_an_unreachable_upstream_gets_a_502_and_a_recorded_error(memory_recorder, finished_requests):
    with running_proxy(f"http://127.0.0.1:{free_port()}", memory_recorder) as proxy:
        answer = httpx.post(proxy + "/v1/completions", json=COMPLETION, timeout=60)
    assert answer.status_code == 502
    assert "could not be reached" in answer.json()["error"]["message"]
    (attributes, _, span), = finished_requests(memory_recorder)
    assert span.status.status_code.name == "ERROR"


def test_other_paths_pass_through(llama_server, memory_recorder, finished_requests):
    with running_proxy(llama_server, memory_recorder) as proxy:
        through_proxy = httpx.get(proxy + "/v1/models", timeout=30).json()
        direct = httpx.get(llama_server + "/v1/models", timeout=30).json()
        tokens = httpx.post(proxy + "/tokenize", json={"content": "hello"}, timeout=30).json()
        direct_tokens = httpx.post(llama_server + "/tokenize", json={"content": "hello"}, timeout=30).json()
    # llama-server stamps each model listing with the second it answered; the rest must match.
    for listing in (through_proxy, direct):
        for model in listing["data"]:
            model.pop("created")
    assert through_proxy == direct
    assert tokens == direct_tokens and tokens["tokens"]
    assert finished_requests(memory_recorder) == []


def test_llama_server_and_kvtrace_proxy_started_as_the_readme_shows_record_spans_the_database_reads(
        tiny_gguf, tmp_path, db, spool_dir):
    """The two commands themselves: llama-server with its log, and the proxy in a separate process writing
    the spool, read back with the saved views; the log gives each request its task and slot."""
    from kvtrace.collectors.ingest import ingest_paths

    port, proxy_port, log = free_port(), free_port(), tmp_path / "server.log"
    serve = readme_command(SERVE, {"llama-server": str(llama_server_binary()), "MODEL.gguf": str(tiny_gguf),
                                   "8080": str(port), "server.log": str(log)})
    with started_llama_server([*serve, "--host", "127.0.0.1", "-np", "1", *SIZING], port,
                              tmp_path / "server.out") as server:
        argv = [*readme_command(PROXY, {"http://127.0.0.1:8080": server, "server.log": str(log)}),
                "--listen", f"127.0.0.1:{proxy_port}", "--run-id", "behind-the-proxy"]
        with proxy_process(argv, proxy_port, tmp_path / "proxy.log") as proxy:
            for turn in range(2):
                httpx.post(proxy + "/v1/chat/completions", json={**CHAT, "max_tokens": 5},
                           headers={"baggage": f"kvtrace.episode_id=kitchen,kvtrace.turn={turn}"}, timeout=120)

    ingest_paths(db, [spool_dir])
    rows = db.query("SELECT run_id, episode_id, turn, engine, length(token_ids), length(margins), reused_tokens, "
                    f"SpanAttributes['{sc.SERVER_TASK_MATCH}'], SpanAttributes['{sc.SERVER_SLOT_ID}'] "
                    "FROM kvtrace_requests INNER JOIN otel_traces USING (SpanId) ORDER BY turn").result_rows
    assert [row[:4] for row in rows] == [("behind-the-proxy", "kitchen", 0, "llama-server"),
                                         ("behind-the-proxy", "kitchen", 1, "llama-server")]
    assert all(row[4] == row[5] == 5 for row in rows)
    assert rows[1][6] > 0  # the second turn of the same prompt was served from the slot's cache
    assert [row[7:] for row in rows] == [(sc.TASK_MATCH_MARKER, "0")] * 2  # matched to the log's tasks


def turn(proxy, prompt, episode, number, run=""):
    """One turn of a conversation through the proxy (a completion of 6 tokens); the text it added.

    ``run``: the run id the client's baggage names ('' = none: the proxy's own)."""
    bag = f"kvtrace.episode_id={episode},kvtrace.turn={number}" + (f",kvtrace.run_id={run}" if run else "")
    return httpx.post(proxy + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0},
                      headers={"baggage": bag}, timeout=120).json()["choices"][0]["text"]


def test_a_prompt_restored_from_llama_servers_cache_names_the_request_that_stored_it(tiny_gguf, tmp_path,
                                                                                     memory_recorder,
                                                                                     finished_requests):
    """Two conversations take turns on one slot: each turn pushes the other's state into the prompt
    cache (--cache-ram), and the next turn of a conversation is served from its own earlier state."""
    log_path = tmp_path / "server.log"
    kitchen = "The kitchen has a long oak table and"
    harbour = "Zulu harbour boats rocked under grey skies while"
    with running_llama_server(tiny_gguf, "-lv", "4", "--cache-ram", "64", log_path=log_path) as server:
        with running_proxy(server, memory_recorder, llama_server_log=log_path) as proxy:
            kitchen += turn(proxy, kitchen, "kitchen", 0)
            harbour += turn(proxy, harbour, "harbour", 0)
            turn(proxy, kitchen + " Next, the pantry holds", "kitchen", 1)

    kitchen_0, harbour_0, kitchen_1 = finished_requests(memory_recorder)
    restores = [e for e in kitchen_1[1] if e[0] == sc.EVENT_CACHE_RESTORE]
    assert len(restores) == 1, kitchen_1[1]
    restored = restores[0][1]
    assert restored[sc.EVENT_LAYER] == sc.LAYER_PROMPT_CACHE
    assert restored[sc.EVENT_SOURCE_SPAN_ID] == "%016x" % kitchen_0[2].context.span_id
    assert (restored[sc.EVENT_SOURCE_EPISODE_ID], restored[sc.EVENT_SOURCE_TURN]) == ("kitchen", 0)
    assert 0 < restored[sc.EVENT_PREFIX_TOKENS] <= restored[sc.EVENT_TOKENS]
    attributes = kitchen_1[0]
    assert attributes[sc.CACHE_LAYER] == sc.LAYER_PROMPT_CACHE
    assert attributes[sc.CACHE_SOURCE_SPAN_ID] == restored[sc.EVENT_SOURCE_SPAN_ID]
    assert attributes[sc.CACHE_REUSED_TOKENS] > 0
    assert attributes[sc.SERVER_TASK_MATCH] == sc.TASK_MATCH_MARKER
    assert attributes[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VERIFIED
    assert json.loads(attributes[sc.CACHE_SETTINGS])["cache_ram_mib"] == 64
    # The harbour turn found nothing of its own in the cache: a miss, and the prompt recomputed.
    assert not [e for e in harbour_0[1] if e[0] == sc.EVENT_CACHE_RESTORE]
    assert harbour_0[0][sc.CACHE_LAYER] != sc.LAYER_PROMPT_CACHE


def test_a_client_that_leaves_mid_stream_is_recorded_as_cancelled(llama_server, memory_recorder, finished_requests):
    with running_proxy(llama_server, memory_recorder) as proxy:
        with httpx.stream("POST", proxy + "/completion", json={**NATIVE, "n_predict": 400, "stream": True},
                          timeout=120) as answer:
            for _, _ in zip(range(3), answer.iter_lines()):
                pass
        deadline = time.monotonic() + 60
        while not memory_recorder.pipeline.exporter.get_finished_spans() and time.monotonic() < deadline:
            memory_recorder.pipeline.force_flush()
            time.sleep(0.1)
    (attributes, _, _), = finished_requests(memory_recorder)
    assert attributes[sc.OUTPUT_FINISH_REASON] == sc.FINISH_CANCELLED
    assert 0 < len(attributes[sc.OUTPUT_MARGINS]) < 400  # the tokens that were generated before it left


class BrokenRecorder:
    """kvtrace's own recording failing (not the engine): the request must go through regardless."""

    def __init__(self):
        self.pipeline = type("Pipeline", (), {"counters": SpanCounters()})()

    def start_request(self, *args, **kwargs):
        raise RuntimeError("the recorder is broken")


def test_a_tracing_failure_never_fails_the_request(llama_server):
    broken = BrokenRecorder()
    body = {**CHAT, "cache_prompt": False}
    with running_proxy(llama_server, broken) as proxy:
        proxied = httpx.post(proxy + "/v1/chat/completions", json=body, timeout=120)
    direct = httpx.post(llama_server + "/v1/chat/completions", json=body, timeout=120)
    assert proxied.status_code == 200
    assert same_bytes(proxied.content) == same_bytes(direct.content)
    assert broken.pipeline.counters["instrumentation_errors"] == 1


def test_requests_in_flight_together_are_told_apart_by_the_marker_the_log_prints(tiny_gguf, tmp_path, memory_recorder,
                                                                                  finished_requests):
    """Two requests on one slot, the second sent while the first streams: each gets its own task."""
    log_path = tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", log_path=log_path) as server:
        with running_proxy(server, memory_recorder, llama_server_log=log_path) as proxy:
            long = {"prompt": "The kitchen has a long oak table and", "n_predict": 300, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", proxy + "/completion", json=long, timeout=120) as first:
                lines = first.iter_lines()
                next(lines)  # the first request is being answered ...
                second = httpx.post(proxy + "/completion", json={"prompt": "Zulu harbour boats rocked",
                                                                 "n_predict": 8, "temperature": 0}, timeout=120)
                assert second.status_code == 200  # ... while the second one is sent
                # The marker's echo is set back: the client sees the server's own default.
                assert second.json()["generation_settings"]["dry_penalty_last_n"] == 64
                for _ in lines:
                    pass
    first, second = (attributes for attributes, _, _ in finished_requests(memory_recorder))  # by start
    assert [a[sc.SERVER_TASK_MATCH] for a in (first, second)] == [sc.TASK_MATCH_MARKER] * 2
    tasks = {int(m[1]): int(m[2]) for m in re.finditer(r"task (\d+) \| new prompt, .*task\.n_tokens = (\d+)",
                                                         log_path.read_text())}
    assert tasks[first[sc.SERVER_TASK_ID]] == first[sc.GEN_AI_USAGE_INPUT_TOKENS]
    assert tasks[second[sc.SERVER_TASK_ID]] == second[sc.GEN_AI_USAGE_INPUT_TOKENS]
    assert first[sc.SERVER_TASK_ID] != second[sc.SERVER_TASK_ID]


def deferred_requests(server: str) -> int:
    """How many requests llama-server holds back, waiting for a slot (its /metrics)."""
    metrics = httpx.get(server + "/metrics", timeout=10).text
    return int(float(re.search(r"^llamacpp:requests_deferred (\S+)", metrics, re.M)[1]))


def test_requests_the_proxy_cannot_mark_are_matched_by_their_counts_or_left_ambiguous(tiny_gguf, tmp_path,
                                                                                     memory_recorder,
                                                                                     finished_requests):
    """Clients that set DRY's window themselves get no marker: counts tell their tasks apart where they
    differ, and two requests the server answers with the very same counts stay ``ambiguous``."""
    log_path = tmp_path / "server.log"
    own = {"dry_penalty_last_n": 64, "temperature": 0, "ignore_eos": True}
    with running_llama_server(tiny_gguf, "-lv", "4", "--metrics", log_path=log_path) as server:
        with running_proxy(server, memory_recorder, llama_server_log=log_path) as proxy:
            def send(body):
                return httpx.post(proxy + "/v1/completions", json={**own, **body}, timeout=120).json()

            with ThreadPoolExecutor(2) as pool:
                # Different prompts and lengths: the counts decide.
                list(pool.map(send, [{"prompt": "A lighthouse keeper counted", "max_tokens": 8},
                                     {"prompt": "Seven quiet herons stood in the reeds", "max_tokens": 4}]))
                # The same request twice, both waiting in the server while the one slot is busy, so
                # neither task starts before both went out; with the prompt recomputed (cache_prompt
                # off) the server answers both with the same counts.
                busy = {"prompt": "The kitchen has a long oak table and", "n_predict": 1000, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                with httpx.stream("POST", proxy + "/completion", json=busy, timeout=120) as blocker:
                    lines = blocker.iter_lines()
                    next(lines)
                    twins = pool.map(send, [{"prompt": "Twin lamps", "max_tokens": 6, "cache_prompt": False}] * 2)
                    deadline, seen = time.monotonic() + 60, 0
                    while seen < 2 and time.monotonic() < deadline:
                        seen = max(seen, deferred_requests(server))
                    for _ in lines:
                        pass
                list(twins)
    assert seen == 2, "the twins did not both wait for the slot"
    spans = [attributes for attributes, _, _ in finished_requests(memory_recorder)]
    different, twins = spans[:2], [a for a in spans[3:]]
    assert [a[sc.SERVER_TASK_MATCH] for a in different] == [sc.TASK_MATCH_TIMINGS] * 2
    assert len({a[sc.SERVER_TASK_ID] for a in different}) == 2
    assert spans[2][sc.SERVER_TASK_MATCH] == sc.TASK_MATCH_MARKER  # the request holding the slot
    assert [a[sc.SERVER_TASK_MATCH] for a in twins] == [sc.TASK_MATCH_AMBIGUOUS] * 2
    assert all(sc.SERVER_TASK_ID not in a and sc.CACHE_INTEGRITY not in a for a in twins)


SYSTEM = "You are the ship's cook. Answer in one line."


def test_sixteen_conversations_at_once_on_four_slots_are_each_tied_to_their_own_task(tiny_gguf, tmp_path,
                                                                                     memory_recorder,
                                                                                     finished_requests):
    """llama-server with four slots behind the proxy, sixteen clients at once (chat, completions and the
    native endpoint, half streamed, sharing a system prompt): every request is one span, tied to its own
    task and slot by the marker, and every state a task kept is verified as the prompt's own prefix."""
    log_path = tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", "--cache-ram", "64", log_path=log_path, slots=4) as server:
        with running_proxy(server, memory_recorder, llama_server_log=log_path) as proxy:
            def conversation(number):
                messages, text, slots = [{"role": "system", "content": SYSTEM}], f"{SYSTEM} Story {number}:", []
                stream = number % 2 == 0
                for turn in range(2):
                    headers = {"baggage": f"kvtrace.episode_id=c{number},kvtrace.turn={turn}"}
                    if number % 3 == 0:
                        messages.append({"role": "user", "content": f"Dish {number}, course {turn}?"})
                        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": 4}
                    else:
                        text += f" then {number * 7 + turn}"
                        path = "/completion" if number % 3 == 1 else "/v1/completions"
                        body = {"prompt": text, "n_predict" if path == "/completion" else "max_tokens": 4}
                    answer = httpx.post(proxy + path, json={**body, "temperature": 0, "stream": stream},
                                        headers=headers, timeout=120)
                    assert answer.status_code == 200
                    documents = sse_payloads(answer.content) if stream else [answer.json()]
                    said = "".join((d.get("content") or "") + "".join(
                        (c.get("delta") or {}).get("content") or c.get("text") or (c.get("message") or {}).get(
                            "content") or "" for c in d.get("choices") or ()) for d in documents if d)
                    # A stream's first events say -1 (no slot yet); its last one says which served it.
                    slots.append(next((d["id_slot"] for d in reversed(documents) if d and "id_slot" in d), None))
                    messages.append({"role": "assistant", "content": said})
                    text += said
                return slots

            with ThreadPoolExecutor(16) as pool:
                answered_slots = dict(enumerate(pool.map(conversation, range(16))))

    spans = finished_requests(memory_recorder)
    assert len(spans) == 32  # every request once
    by_turn = {(a[sc.EPISODE_ID], a[sc.TURN]): a for a, _, _ in spans}
    assert len(by_turn) == 32
    assert {a[sc.SERVER_TASK_MATCH] for a in by_turn.values()} == {sc.TASK_MATCH_MARKER}
    assert len({a[sc.SERVER_TASK_ID] for a in by_turn.values()}) == 32
    started = {int(m[2]): int(m[1]) for m in re.finditer(r"id\s+(\d+) \| task (\d+) \| processing task",
                                                         log_path.read_text())}
    for (episode, turn), attributes in by_turn.items():
        assert attributes[sc.SERVER_SLOT_ID] == started[attributes[sc.SERVER_TASK_ID]]
        answered = answered_slots[int(episode[1:])][turn]
        if answered is not None:  # the native endpoint says which slot served it
            assert attributes[sc.SERVER_SLOT_ID] == answered
    # How the server chose each slot, as its log says: empty slots by LRU at first, then slots whose
    # state shares the conversation's prefix by similarity, with the share it had.
    chosen = {(a[sc.SERVER_SLOT_SELECTED_BY], sc.SERVER_SLOT_SIMILARITY in a) for a in by_turn.values()}
    assert chosen == {(sc.SLOT_SELECTED_BY_LRU, False), (sc.SLOT_SELECTED_BY_LCP_SIMILARITY, True)}
    assert all(0 < a[sc.SERVER_SLOT_SIMILARITY] <= 1 for a in by_turn.values() if sc.SERVER_SLOT_SIMILARITY in a)
    # Every state a task kept is verified as the prompt's own, unless the log itself could not say
    # whose it was (a restore with reason source_unknown: two alike cached prompts, one dropped).
    kept = [(a, events) for a, events, _ in spans if a[sc.CACHE_REUSED_TOKENS] > 0]
    assert kept  # the shared system prompt and the turns before are reused
    unexplained = [(a[sc.EPISODE_ID], a[sc.TURN], a.get(sc.CACHE_INTEGRITY), a[sc.SERVER_TASK_ID]) for a, events in kept
                   if a.get(sc.CACHE_INTEGRITY) != sc.INTEGRITY_VERIFIED and not any(
                       e[0] == sc.EVENT_CACHE_RESTORE and e[1].get(sc.EVENT_REASON) == sc.REASON_SOURCE_UNKNOWN
                       for e in events)]
    assert not unexplained
    assert sum(a.get(sc.CACHE_INTEGRITY) == sc.INTEGRITY_VERIFIED for a, _ in kept) >= len(kept) // 2
    assert not [e for _, events, _ in spans for e in events if e[0] == sc.EVENT_CACHE_INTEGRITY_VIOLATION]
    # How the server batched its slots' steps is out of the proxy's sight: every span says so, with no arrays.
    assert {a[sc.BATCH_COMPOSITION] for a in by_turn.values()} == {sc.BATCH_UNKNOWN}
    assert not [a for a in by_turn.values() if sc.OUTPUT_STEP_ROWS in a or sc.PROMPT_PREFILL_STEPS in a]


class DoctoredLog:
    """llama-server's log copied line by line into the file the proxy reads, where one line can be doctored.

    ``doctor(edit)``: the next candidate line of a prompt-cache lookup is rewritten by ``edit`` (which
    returns the lines to write instead), as a server whose cache served another prompt's state would log it.
    """

    def __init__(self, source, target):
        self.source, self.target = source, target
        self._edit = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._copy, daemon=True)

    def __enter__(self):
        self.target.write_bytes(b"")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(timeout=10)

    def doctor(self, edit):
        self._edit = edit

    def _copy(self):
        offset, partial = 0, b""
        while not self._stop.is_set():
            with open(self.source, "rb") as source:
                source.seek(offset)
                data = source.read()
            offset += len(data)
            lines = (partial + data).split(b"\n")
            partial = lines.pop()
            out = []
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                if self._edit is not None and "- prompt with length" in line:
                    out.extend(self._edit(line))
                    self._edit = None
                else:
                    out.append(line)
            if out:
                with open(self.target, "a") as target:
                    target.write("\n".join(out) + "\n")
            time.sleep(0.002)


def test_a_restore_of_another_conversations_state_is_caught_listed_counted_and_alerted(tiny_gguf, tmp_path,
                                                                                       spool_recorder, spool_dir,
                                                                                       db):
    """Fault injection: the log the proxy reads says the harbour turn was served from the kitchen
    conversation's cached state, with more of it in common than the two prompts share. The proxy
    compares the state's tokens, as it saw the kitchen request, with the harbour prompt: violated, and
    the event names both sides. The kitchen's own next turn, restored for real, is verified; so is the
    reuse in a second, honest run on the same server. Stored in the database, the saved query lists
    the violation, ``kvtrace runs`` counts it and an alert rule fires for the doctored run only.

    ``kvtrace diff`` has no fork to label here: only the log was doctored, the server computed the
    harbour answer from the harbour prompt, so the client's output is what an honest run gets."""
    server_log, proxy_log = tmp_path / "server.log", tmp_path / "proxy-reads.log"
    kitchen = "The kitchen has a long oak table and"
    harbour = "Zulu harbour boats rocked under grey skies while"
    garden = "Quiet garden paths wound past the old stone well"

    def foreign_restore(line):
        length = int(re.search(r"length\s+(\d+)", line)[1])
        return [re.sub(r"lcp =\s+\d+, f_keep = [\d.]+, f_sim = [\d.]+",
                       f"lcp = {length:7d}, f_keep = 1.000, f_sim = 0.990", line),
                line[:line.index("- prompt with length")] + "- found better prompt with f_keep = 1.000, f_sim = 0.990"]

    with running_llama_server(tiny_gguf, "-lv", "4", "--cache-ram", "64", log_path=server_log) as server, \
            DoctoredLog(server_log, proxy_log) as doctored:
        with running_proxy(server, spool_recorder, llama_server_log=proxy_log) as proxy:
            kitchen += turn(proxy, kitchen, "kitchen", 0, run="doctored")
            doctored.doctor(foreign_restore)
            harbour += turn(proxy, harbour, "harbour", 0, run="doctored")
            turn(proxy, kitchen + " Next, the pantry holds", "kitchen", 1, run="doctored")
            garden += turn(proxy, garden, "garden", 0, run="honest")
            turn(proxy, garden + " Then the gate", "garden", 1, run="honest")
    store(spool_recorder, spool_dir, db)

    spans = {(run, episode, int(number)): (span_id, task_match, verdict)
             for run, episode, number, span_id, task_match, verdict in db.query(
                 f"SELECT SpanAttributes['{sc.RUN_ID}'], SpanAttributes['{sc.EPISODE_ID}'], "
                 f"SpanAttributes['{sc.TURN}'], SpanId, SpanAttributes['{sc.SERVER_TASK_MATCH}'], "
                 f"SpanAttributes['{sc.CACHE_INTEGRITY}'] FROM otel_traces").result_rows}
    assert {key: verdict for key, (_, _, verdict) in spans.items()} == {
        ("doctored", "kitchen", 0): "",  # nothing was reused: nothing to verify
        ("doctored", "harbour", 0): sc.INTEGRITY_VIOLATED, ("doctored", "kitchen", 1): sc.INTEGRITY_VERIFIED,
        # The garden's first turn keeps the slot's first token (BOS, the kitchen's): its own prefix too.
        ("honest", "garden", 0): sc.INTEGRITY_VERIFIED, ("honest", "garden", 1): sc.INTEGRITY_VERIFIED}
    assert spans["doctored", "harbour", 0][1] == sc.TASK_MATCH_MARKER

    # The saved query lists it with both sides: the harbour request, and the kitchen request whose state it was.
    columns, rows = queries.run(db, "integrity_violations", {"run": "doctored"})
    (violation,) = [dict(zip(columns, row)) for row in rows]
    assert (violation["episode_id"], violation["turn"], violation["engine"]) == ("harbour", 0, "llama-server")
    assert violation["span_id"] == spans["doctored", "harbour", 0][0]
    assert violation["reason"] == sc.INTEGRITY_FOREIGN_PROMPT and violation["layer"] == sc.LAYER_PROMPT_CACHE
    assert violation["matched_tokens"] < violation["used_tokens"]  # the tokens that did match
    assert violation["source_span_id"] == spans["doctored", "kitchen", 0][0]
    assert (violation["source_run_id"], violation["source_episode_id"], violation["source_turn"]) == (
        "doctored", "kitchen", 0)
    assert queries.run(db, "integrity_violations", {"run": "honest"})[1] == []

    # kvtrace runs counts it, and an alert rule on the violation count fires for the doctored run only.
    assert_counted_and_alerted(db, "doctored", "honest", engine="llama-server")
