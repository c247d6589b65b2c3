"""``kvtrace proxy --shadow`` in front of vLLM's OpenAI server (traced by kvtrace's plugin).

The story: the proxy sends a cold twin of every cache-hit request after its client has the answer,
with a fresh ``cache_salt`` so that no cached block serves it. vLLM's engine records both; the twin
carries arm ``shadow`` in its baggage, so ``margin_shift`` pairs each hit with its twin. Clients
see what they would see without the proxy's twins.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
pytest.importorskip("h11")
httpx = pytest.importorskip("httpx")

from integrity_readback import store  # noqa: E402
from kvtrace import queries, semconv as sc  # noqa: E402
from kvtrace.proxy.limits import ShadowBudget  # noqa: E402
from kvtrace.proxy.app import proxy_in_thread  # noqa: E402
from kvtrace.recording.stats import SHADOW_TWINS_DROPPED, SHADOW_TWINS_SENT  # noqa: E402
from llama_server_process import same_bytes  # noqa: E402
from vllm_server_process import MODEL_NAME, running_vllm_server  # noqa: E402

OPENING = "the agent opens the file and reads the first line of the configuration " * 3
FOLLOW_UPS = (" then it asks a question", " and writes a short note")
WAIT_S = 120


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-hf")


def conversation(proxy: str, recorder, run: str) -> list[bytes]:
    """Three turns (top two logprobs asked), each prompt the last plus its answer and more; the raw
    answers. Each turn waits for the proxy's spans before it (a hit's include its twin's)."""
    prompt, answers, done = OPENING, [], recorder.pipeline.counters["spans_finished"]
    for number, more in enumerate(("",) + FOLLOW_UPS):
        prompt += more
        raw = httpx.post(proxy + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2},
            headers={"baggage": f"kvtrace.run_id={run},kvtrace.episode_id=e,kvtrace.turn={number}"}).content
        answers.append(raw)
        done += 1 + (run.startswith("shadowed") and cached(raw) > 0)
        deadline = time.monotonic() + WAIT_S
        while recorder.pipeline.counters["spans_finished"] < done:
            assert time.monotonic() < deadline, "the proxy's spans did not come"
            time.sleep(0.05)
        prompt += httpx.Response(200, content=raw).json()["choices"][0]["text"]
    return answers


def cached(raw: bytes) -> int:
    details = httpx.Response(200, content=raw).json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def margins(choice: dict) -> tuple[list[str], list[float]]:
    """Chosen tokens and top-1 − top-2 logprob per position, from an answer's own logprobs."""
    tops = [sorted(top.values(), reverse=True) for top in choice["logprobs"]["top_logprobs"]]
    return choice["logprobs"]["tokens"], [a - b for a, b, *_ in tops]


def twins_decided_while_busy(base: str, prompt: str, recorder, hits: int = 3) -> tuple[int, int]:
    """Hits sent one by one through a shadowing proxy (``busy`` 0) while three clients keep long answers
    of different lengths on their way through it, each sending its next as the last ends (so their gaps
    seldom meet). Returns the twins of the hits the budget sent and dropped."""
    counters, stop = recorder.pipeline.counters, threading.Event()
    with proxy_in_thread(base, recorder, shadow=ShadowBudget(1.0)) as proxy, ThreadPoolExecutor(3) as pool, \
            httpx.Client(base_url=proxy, timeout=120, headers={"baggage": "kvtrace.run_id=busy"}) as client:
        def keep_busy(long_prompt: str, tokens: int, started: threading.Event) -> None:
            while not stop.is_set():
                with client.stream("POST", "/v1/completions", json={
                        "model": MODEL_NAME, "prompt": long_prompt, "max_tokens": tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as answer:
                    for _ in answer.iter_bytes():
                        started.set()
                    assert answer.status_code == 200

        try:
            loops = []
            # Misses that say so (their usage): no twin of their own.
            for long_prompt, tokens in (("a", 240), ("b", 170), ("c", 110)):
                started = threading.Event()
                loops.append(pool.submit(keep_busy, long_prompt, tokens, started))
                assert started.wait(WAIT_S), "a long answer did not start"
            before = counters.snapshot()
            for _ in range(hits):
                assert cached(client.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}).content) > 0
            deadline = time.monotonic() + WAIT_S
            while (now := counters.snapshot())[SHADOW_TWINS_SENT] + now[SHADOW_TWINS_DROPPED] < \
                    before[SHADOW_TWINS_SENT] + before[SHADOW_TWINS_DROPPED] + hits:
                assert time.monotonic() < deadline, "the proxy did not decide on the hits' twins"
                time.sleep(0.01)
            assert all(not loop.done() for loop in loops)  # still busy as the last was decided
        finally:
            stop.set()
        for loop in loops:
            loop.result()
    return now[SHADOW_TWINS_SENT] - before[SHADOW_TWINS_SENT], now[SHADOW_TWINS_DROPPED] - before[SHADOW_TWINS_DROPPED]


@pytest.mark.slow
def test_vllm_hits_are_paired_with_salted_cold_twins_and_clients_see_no_difference(hf_model, spool_recorder,
                                                                                   spool_dir, db, tmp_path):
    log_path = tmp_path / "server.log"
    # The answers say what was served from cache (else every sampled request would get a twin).
    with running_vllm_server(hf_model, spool_dir, log_path, "--enable-prompt-tokens-details",
                             env={"VLLM_SERVER_DEV_MODE": "1"}) as (base, stop):
        with proxy_in_thread(base, spool_recorder, shadow=ShadowBudget(1.0)) as proxy:
            shadowed = conversation(proxy, spool_recorder, "shadowed")
        # The same conversation on the same cache states: the prefix cache emptied, no twins.
        assert httpx.post(base + "/reset_prefix_cache", timeout=60).status_code == 200
        with proxy_in_thread(base, spool_recorder) as proxy:
            plain = conversation(proxy, spool_recorder, "plain")
        hit_turns = [n for n, raw in enumerate(shadowed) if cached(raw) > 0]
        hits = [httpx.Response(200, content=shadowed[n]).json()["choices"][0] for n in hit_turns]
        # Independently of kvtrace: each hit's prompt recomputed (a salt no block was stored under).
        prompts, prompt = [], OPENING
        for raw, more in zip(shadowed, ("",) + FOLLOW_UPS):
            prompts.append(prompt := prompt + more)
            prompt += httpx.Response(200, content=raw).json()["choices"][0]["text"]
        cold = [httpx.post(base + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": prompts[n], "max_tokens": 8, "temperature": 0, "logprobs": 2,
            "cache_salt": secrets.token_hex(16)}).json()["choices"][0] for n in hit_turns]
        twins_so_far = spool_recorder.pipeline.counters.snapshot()
        sent_while_busy, dropped_while_busy = twins_decided_while_busy(base, prompts[1], spool_recorder)
        stop()
    assert hit_turns == [1, 2], log_path.read_text(errors="replace")[-3000:]  # each follow-up reuses blocks
    # The conversation's hits were answered with nothing else upstream (twins sent); a hit decided on
    # while another request was upstream had its twin dropped.
    assert (twins_so_far[SHADOW_TWINS_SENT], twins_so_far[SHADOW_TWINS_DROPPED]) == (2, 0)
    assert (sent_while_busy, dropped_while_busy) == (0, 3)
    assert [same_bytes(raw) for raw in shadowed] == [same_bytes(raw) for raw in plain]

    store(spool_recorder, spool_dir, db)
    # The engine's records (no reused_tokens_source: it knows) stand for the requests the proxy recorded
    # too (queries/shared/requests_once.sql): a twin is a cold request of the same prompt, arm shadow.
    rows = db.query("SELECT turn, arm, reused_tokens, prompt_hash FROM kvtrace_requests FINAL "
                    "WHERE run_id = 'shadowed' AND reused_tokens_source = '' ORDER BY turn, Timestamp").result_rows
    assert [(turn, arm) for turn, arm, *_ in rows] == [(0, ""), (1, ""), (1, sc.ARM_SHADOW), (2, ""),
                                                       (2, sc.ARM_SHADOW)]
    for hit, twin in (rows[1:3], rows[3:5]):
        assert hit[2] > 0 and twin[2] == 0 and hit[3] == twin[3]

    # margin_shift over the pairs against the shift from the answers' own logprobs (float32
    # log-softmax, hence the tolerance), position by position while the chosen tokens agree.
    expected = []
    for hit, recomputed in zip(hits, cold):
        (hit_tokens, hit_margins), (cold_tokens, cold_margins) = margins(hit), margins(recomputed)
        for a, b, token_a, token_b in zip(hit_margins, cold_margins, hit_tokens, cold_tokens):
            expected.append(a - b)
            if token_a != token_b:
                break
    columns, answer = queries.run(db, "margin_shift", {"run_prefix": "shadowed", "reference_arm": sc.ARM_SHADOW})
    overall = dict(zip(columns, answer[-1]))
    assert (overall["request_pairs"], overall["shadow_pairs"], overall["shadow_episodes"]) == (2, 2, 1)
    assert overall["positions"] == len(expected)
    assert overall["mean_shift"] == pytest.approx(sum(expected) / len(expected), abs=1e-4)
