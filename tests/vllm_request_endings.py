"""Requests that end every way vLLM ends one, in one engine call, then an abort mid-answer: what the vLLM
tests check kvtrace's rows against (tests/test_vllm_engine.py, tests/vllm_v2_workload.py)."""

from __future__ import annotations

PROBE_PROMPT = "the agent stops at a token"
SAMPLED_PROMPT = "the agent drafts two answers"


def requests_ending_every_way(probe, greedy: dict) -> list:
    """(prompt, SamplingParams) for a stop token and a stop string taken from ``probe`` (the greedy
    completion of :data:`PROBE_PROMPT`), ``max_tokens=1``, ``n=2`` sampled, and 12 mixed lengths: 16
    requests in the engine core, which preempts one on a KV cache of 12 blocks of 32 tokens."""
    from vllm import SamplingParams

    stop_token, stop_text = probe.token_ids[3], probe.text[len(probe.text) // 2:][:3]
    requests = [(PROBE_PROMPT, SamplingParams(max_tokens=8, stop_token_ids=[stop_token], **greedy)),
                ("the agent stops at a string", SamplingParams(max_tokens=16, stop=[stop_text], **greedy)),
                ("the agent says one word", SamplingParams(max_tokens=1, **greedy)),
                (SAMPLED_PROMPT, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True))]
    return requests + [(f"request {i} " + "with a longer prompt " * (i % 5 * 3),
                        SamplingParams(max_tokens=4 + 3 * i, **greedy)) for i in range(12)]


def abort_mid_answer(engine, greedy: dict) -> None:
    """A request aborted after three engine steps; the engine stepped until nothing is left."""
    from vllm import SamplingParams

    engine.add_request("abort-me", "the agent is cut off mid answer", SamplingParams(max_tokens=64, **greedy))
    for _ in range(3):
        engine.step()
    engine.abort_request(["abort-me"])
    while engine.has_unfinished_requests():
        engine.step()
