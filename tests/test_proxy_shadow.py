"""``kvtrace proxy --shadow`` in front of a real llama-server.

The story: an operator wants the margin-shift alert to watch live traffic, not a canary. The proxy
sends a cold twin of each sampled cache-hit request after its client has the answer; the twin is
recorded as a recompute of the same prompt (arm ``shadow``), so ``margin_shift`` pairs the two.
Clients see exactly what they would see without shadowing, and a full budget drops twins (counted)
rather than queueing them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from integrity_readback import store
from kvtrace import queries, semconv as sc
from kvtrace.proxy.limits import ShadowBudget
from kvtrace.recording.stats import SHADOW_TWINS_DROPPED, SHADOW_TWINS_SENT, SHADOW_TWINS_STATE_LEFT
from llama_server_process import free_port, proxy_process, running_llama_server, same_bytes
from readme_commands import readme_command

pytest.importorskip("h11")
from kvtrace.proxy.app import proxy_in_thread  # noqa: E402  (needs h11)

OPENING = "The lighthouse keeper climbed the stairs and"
FOLLOW_UPS = (" Then the storm", " At dawn the boats")
SPANS_WAIT_S = 120


def spans_finished(recorder, expected: int) -> None:
    """Wait until the recorder has finished ``expected`` spans (a twin's comes after its client's answer)."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while recorder.pipeline.counters["spans_finished"] < expected:
        assert time.monotonic() < deadline, f"{recorder.pipeline.counters['spans_finished']} of {expected} spans"
        time.sleep(0.05)


def conversation(proxy: str, recorder, run: str, logprobs: bool, twins: bool) -> list[bytes]:
    """Three turns, each prompt the last one plus its answer and more text; the raw answers.

    Each turn waits for the spans before it (with ``twins``, the twin of every turn that reused
    state), so a twin never shares an engine step with the next turn."""
    prompt, answers, done = OPENING, [], recorder.pipeline.counters["spans_finished"]
    for number, more in enumerate(("",) + FOLLOW_UPS):
        prompt += more
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **({"n_probs": 2} if logprobs else {})}
        raw = httpx.post(proxy + "/v1/completions", json=body, timeout=120,
                         headers={"baggage": f"kvtrace.run_id={run},kvtrace.episode_id=e,kvtrace.turn={number}"}).content
        answers.append(raw)
        done += 1 + (twins and reused(raw) > 0)
        spans_finished(recorder, done)
        prompt += httpx.Response(200, content=raw).json()["choices"][0]["text"]
    return answers


def reused(raw: bytes) -> int:
    """The prompt tokens the server says it served from cache."""
    return httpx.Response(200, content=raw).json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def matched_shift(hit: list[dict], cold: list[dict]) -> list[float]:
    """hit − cold margin per position while the chosen tokens agree, and at the first that differs."""
    shifts = []
    for a, b in zip(hit, cold):
        margin = lambda p: p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"]  # noqa: E731
        shifts.append(margin(a) - margin(b))
        if a["id"] != b["id"]:
            break
    return shifts


def test_a_shadowed_clients_answers_are_unchanged_and_each_hit_is_paired_with_its_cold_twin(
        tiny_gguf, tmp_path, spool_recorder, spool_dir, db):
    # The log tells the proxy each original's slot, and slot files let it put that slot back after the twin.
    kept = ("-lv", "4", "--slot-save-path", str(tmp_path / "slots"))
    (tmp_path / "slots").mkdir()
    with running_llama_server(tiny_gguf, *kept, log_path=tmp_path / "a.log", slots=2) as shadowed_server, \
            running_llama_server(tiny_gguf, *kept, log_path=tmp_path / "b.log", slots=2) as plain_server:
        with proxy_in_thread(shadowed_server, spool_recorder, llama_server_log=tmp_path / "a.log",
                             shadow=ShadowBudget(1.0)) as proxy:
            shadowed = {logprobs: conversation(proxy, spool_recorder, f"shadowed-{logprobs}", logprobs, twins=True)
                        for logprobs in (False, True)}
        with proxy_in_thread(plain_server, spool_recorder, llama_server_log=tmp_path / "b.log") as proxy:
            plain = {logprobs: conversation(proxy, spool_recorder, f"plain-{logprobs}", logprobs, twins=False)
                     for logprobs in (False, True)}
        # The hits' cold answers, asked of the server that sent no twins, independently of kvtrace.
        hit_turns = [n for n, raw in enumerate(shadowed[True]) if reused(raw) > 0]
        hits = [httpx.Response(200, content=shadowed[True][n]).json()["choices"][0] for n in hit_turns]
        cold = [httpx.post(plain_server + "/v1/completions", timeout=120, json={
            "prompt": prompts_of(shadowed[True])[n], "max_tokens": 8, "temperature": 0, "n_probs": 2,
            "cache_prompt": False}).json()["choices"][0] for n in hit_turns]
    all_hits = {(f"shadowed-{p}", n) for p in (False, True) for n, raw in enumerate(shadowed[p]) if reused(raw) > 0}
    assert {("shadowed-False", 1), ("shadowed-False", 2)} <= all_hits  # each follow-up reuses the turn before
    counters = spool_recorder.pipeline.counters.snapshot()
    assert (counters[SHADOW_TWINS_SENT], counters[SHADOW_TWINS_DROPPED]) == (len(all_hits), 0)

    # Clients: the same bytes with and without twins (ids and clocks aside), with and without logprobs.
    for logprobs in (False, True):
        assert [same_bytes(raw) for raw in shadowed[logprobs]] == [same_bytes(raw) for raw in plain[logprobs]]
    assert counters[SHADOW_TWINS_STATE_LEFT] == 0  # because every twin's slot was put back

    store(spool_recorder, spool_dir, db)
    rows = db.query(
        f"SELECT SpanAttributes['{sc.RUN_ID}'], toInt32(SpanAttributes['{sc.TURN}']), SpanAttributes['{sc.ARM}'], "
        f"toInt64(SpanAttributes['{sc.CACHE_REUSED_TOKENS}']), SpanAttributes['{sc.PROMPT_HASH}'], SpanId, "
        f"ParentSpanId FROM otel_traces WHERE startsWith(SpanAttributes['{sc.RUN_ID}'], 'shadowed') "
        "ORDER BY Timestamp").result_rows
    originals = {(run, number): row for run, number, arm, *row in rows if arm != sc.ARM_SHADOW}
    twins = {(run, number): row for run, number, arm, *row in rows if arm == sc.ARM_SHADOW}
    assert set(twins) == all_hits
    for key, (twin_reused, prompt_hash, _, parent) in twins.items():
        original_reused, original_hash, original_span, _ = originals[key]
        assert original_reused > 0 and twin_reused == 0  # a hit, and its cold twin
        assert prompt_hash == original_hash and parent == original_span

    # margin_shift over the pairs is the shift computed from the two answers' own logprobs.
    expected = [s for hit, recomputed in zip(hits, cold)
                for s in matched_shift(hit["logprobs"]["content"], recomputed["logprobs"]["content"])]
    columns, answer = queries.run(db, "margin_shift", {"run_prefix": "shadowed-True"})
    overall = dict(zip(columns, answer[-1]))
    assert overall["weight_format"] == "(all)" and overall["request_pairs"] == len(hit_turns) >= 2
    assert overall["positions"] == len(expected)
    assert overall["mean_shift"] == pytest.approx(sum(expected) / len(expected), rel=1e-9, abs=1e-12)
    assert overall["max_abs_shift"] == pytest.approx(max(map(abs, expected)), rel=1e-9, abs=1e-12)
    assert overall["shadow_pairs"] == len(hit_turns)

    # divergence_rates against the twins: episode e, forked where a hit's answer is not its cold one.
    columns, answer = queries.run(db, "divergence_rates", {"run_prefix": "shadowed", "baseline_arm": sc.ARM_SHADOW})
    forked = any(hit["text"] != recomputed["text"] for hit, recomputed in zip(hits, cold))
    assert [(row[columns.index("compared_with")], row[columns.index("episodes_compared")],
             row[columns.index("episodes_forked")]) for row in answer] == [(sc.ARM_SHADOW, 1, int(forked))]


def prompts_of(answers: list[bytes]) -> list[str]:
    """The prompts of a conversation's turns, rebuilt from its answers as :func:`conversation` built them."""
    prompt, prompts = OPENING, []
    for raw, more in zip(answers, ("",) + FOLLOW_UPS):
        prompt += more
        prompts.append(prompt)
        prompt += httpx.Response(200, content=raw).json()["choices"][0]["text"]
    return prompts


def test_a_full_budget_drops_twins_and_counts_them_while_every_client_is_served(tiny_gguf, tmp_path,
                                                                              memory_recorder, finished_requests):
    # The minute's tokens have room for about one twin; ``busy`` lets twins go beside clients' requests,
    # so what drops them here is the tokens and the in-flight bound.
    budget = ShadowBudget(1.0, in_flight=1, tokens_per_minute=60, busy=12)
    with running_llama_server(tiny_gguf, log_path=tmp_path / "server.log", slots=2) as server:
        with proxy_in_thread(server, memory_recorder, shadow=budget) as proxy:
            def ask(n: int) -> int:
                return httpx.post(proxy + "/v1/completions", timeout=120, json={
                    "prompt": f"{OPENING} {'and then ' * (n % 3)}", "max_tokens": 4, "temperature": 0}).status_code

            assert ask(0) == 200  # the state the others reuse
            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(ask, range(1, 13))) == [200] * 12
    spans = finished_requests(memory_recorder)
    clients = [a for a, _, _ in spans if a.get(sc.ARM) != sc.ARM_SHADOW]
    twins = [a for a, _, _ in spans if a.get(sc.ARM) == sc.ARM_SHADOW]
    hits = sum(a[sc.CACHE_REUSED_TOKENS] > 0 for a in clients)
    counters = memory_recorder.pipeline.counters.snapshot()
    assert len(clients) == 13 and hits > 1
    # Every hit was sampled (rate 1): a twin sent, or dropped and counted; never queued.
    assert counters[SHADOW_TWINS_SENT] + counters[SHADOW_TWINS_DROPPED] == hits
    assert counters[SHADOW_TWINS_DROPPED] >= 1 and len(twins) == counters[SHADOW_TWINS_SENT] >= 1
    assert all(t[sc.CACHE_REUSED_TOKENS] == 0 for t in twins)


SHADOW = "kvtrace proxy --upstream http://127.0.0.1:8080 --shadow RATE"


def test_the_readme_command_sends_twins_that_kvtrace_runs_counts(tiny_gguf, tmp_path, spool_dir, db):
    from kvtrace.collectors.ingest import ingest_paths

    port = free_port()
    with running_llama_server(tiny_gguf, log_path=tmp_path / "server.log", slots=2) as server:
        argv = [*readme_command(SHADOW, {"http://127.0.0.1:8080": server, "RATE": "1"}),
                "--listen", f"127.0.0.1:{port}", "--run-id", "live"]
        with proxy_process(argv, port, tmp_path / "proxy.log") as proxy:  # its stop waits for the twin
            for prompt in (OPENING, OPENING + FOLLOW_UPS[0]):  # the second reuses the first's state
                answer = httpx.post(proxy + "/v1/completions", timeout=120,
                                    json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert answer.status_code == 200
        cold = httpx.post(server + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_prompt": False}).json()["choices"][0]["text"]
    ingest_paths(db, [spool_dir])
    columns, rows = queries.run(db, "runs")
    (run,) = [dict(zip(columns, row)) for row in rows]
    assert (run["run_id"], run["requests"], run["shadow_twins"]) == ("live", 3, 1)
    assert sc.ARM_SHADOW in run["arms"].split(",")

    # No baggage: each request is an episode of its own, and the hit's is the one with a twin.
    columns, rows = queries.run(db, "divergence_rates", {"baseline_arm": sc.ARM_SHADOW})
    (rate,) = [dict(zip(columns, row)) for row in rows]
    forked = answer.json()["choices"][0]["text"] != cold
    assert (rate["compared_with"], rate["episodes_compared"], rate["episodes_forked"]) == (sc.ARM_SHADOW, 1, forked)


def test_without_slot_files_a_twins_state_is_counted_and_the_next_hit_names_the_twin_as_its_source(
        tiny_gguf, tmp_path, memory_recorder, finished_requests):
    # The server keeps no slot files: each twin's recompute stays in the slot the conversation goes on in.
    with running_llama_server(tiny_gguf, "-lv", "4", log_path=tmp_path / "server.log", slots=2) as server:
        with proxy_in_thread(server, memory_recorder, llama_server_log=tmp_path / "server.log",
                             shadow=ShadowBudget(1.0)) as proxy:
            conversation(proxy, memory_recorder, "left", logprobs=True, twins=True)
    counters = memory_recorder.pipeline.counters.snapshot()
    assert counters[SHADOW_TWINS_SENT] >= 2 and counters[SHADOW_TWINS_STATE_LEFT] == counters[SHADOW_TWINS_SENT]

    spans = [(attributes, f"{span.context.span_id:016x}") for attributes, _, span in finished_requests(memory_recorder)]
    twins = {attributes[sc.TURN]: span_id for attributes, span_id in spans if attributes.get(sc.ARM) == sc.ARM_SHADOW}
    later_hits = [attributes for attributes, _ in spans
                  if attributes.get(sc.ARM) != sc.ARM_SHADOW and attributes[sc.TURN] - 1 in twins]
    assert len(later_hits) == len(twins) - (max(twins) == 2)  # the last turn's twin has no turn after it
    for hit in later_hits:  # the state a hit reused was written by the twin of the turn before, and says so
        assert hit[sc.CACHE_REUSED_TOKENS] > 0 and hit[sc.CACHE_SOURCE_SPAN_ID] == twins[hit[sc.TURN] - 1]
