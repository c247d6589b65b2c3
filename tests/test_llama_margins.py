"""Per-token margins, and tracing that changes nothing.

The story: a user compares two runs and needs, at the fork, the top-1 − top-2
margin of the raw logits.  The recorded margins must equal margins recomputed
independently from the engine's own logits (``logits_all=True`` keeps every
row in ``llm.scores``), and turning tracing on must not change a single token
or logit bit.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from kvtrace import semconv as sc


def episode(llm, turns=3, max_tokens=8, **sampling):
    """A small multi-turn run with prefix reuse and a prompt cache; returns tokens and logits per turn."""
    obs = llm.tokenize(b" Observation follows.", add_bos=False)
    prompt = llm.tokenize(b"Margins are read from raw logits")
    outputs = []
    for _ in range(turns):
        result = llm.create_completion(prompt, max_tokens=max_tokens, logprobs=1, **sampling)
        n = llm.n_tokens
        outputs.append((result["choices"][0]["text"], llm.input_ids[:n].copy(), llm.scores[:n].copy()))
        prompt = llm.input_ids[:n].tolist() + obs
    return outputs


def test_margins_equal_margins_recomputed_from_engine_logits(llama_patched, memory_recorder, make_llama,
                                                             finished_requests):
    llm = make_llama(logits_all=True)
    prompt = llm.tokenize(b"Margins are read from raw logits")
    llm.create_completion(prompt, max_tokens=12, temperature=0.0)
    ((attrs, _, _),) = finished_requests(memory_recorder)

    generated = len(attrs[sc.OUTPUT_MARGINS])
    # Row i of llm.scores holds the logits produced after evaluating position i; token j was
    # sampled from the row of the position just before it.
    rows = llm.scores[len(prompt) - 1: len(prompt) - 1 + generated].astype(np.float64)
    order = np.argsort(-rows, axis=1, kind="stable")
    top1, runner_up = order[:, 0], order[:, 1]
    margins = rows[np.arange(generated), top1] - rows[np.arange(generated), runner_up]
    peak = rows.max(axis=1, keepdims=True)
    log_softmax = rows - peak - np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))

    assert generated > 0
    assert attrs[sc.OUTPUT_TOP1_IDS] == top1.tolist()
    assert attrs[sc.OUTPUT_RUNNER_UP_IDS] == runner_up.tolist()
    assert list(attrs[sc.OUTPUT_MARGINS]) == margins.tolist()  # exact: same float32 inputs
    assert attrs[sc.OUTPUT_TOKEN_IDS] == top1.tolist()  # greedy, no penalties
    chosen = log_softmax[np.arange(generated), np.asarray(attrs[sc.OUTPUT_TOKEN_IDS])]
    np.testing.assert_allclose(attrs[sc.OUTPUT_LOGPROBS], chosen, rtol=0, atol=1e-5)
    assert attrs[sc.OUTPUT_TOKEN_IDS][: generated - 1] == llm.input_ids[len(prompt): llm.n_tokens].tolist()


def test_penalties_change_the_choice_and_both_are_recorded(llama_patched, memory_recorder, make_llama,
                                                           finished_requests):
    llm = make_llama()
    llm.create_completion("repeat repeat repeat repeat", max_tokens=24, temperature=0.0, repeat_penalty=3.0)
    ((attrs, _, _),) = finished_requests(memory_recorder)
    chosen, top1 = attrs[sc.OUTPUT_TOKEN_IDS], attrs[sc.OUTPUT_TOP1_IDS]
    assert len(chosen) == len(top1) == len(attrs[sc.OUTPUT_RUNNER_UP_IDS]) == len(attrs[sc.OUTPUT_LOGPROBS])
    assert all(m >= 0 for m in attrs[sc.OUTPUT_MARGINS])
    assert any(c != t for c, t in zip(chosen, top1))  # the penalty overrode the raw arg-max somewhere
    assert all(lp <= 0 for lp in attrs[sc.OUTPUT_LOGPROBS])


def test_tokens_and_logits_are_bit_identical_with_tracing_on_and_off(memory_recorder, make_llama,
                                                                     finished_requests):
    from kvtrace.patches import llama_cpp as patch

    def run():
        llm = make_llama(logits_all=True)
        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=50 << 20))
        greedy = episode(llm, temperature=0.0)
        sampled = episode(llm, temperature=0.9, seed=123, repeat_penalty=1.1)
        return greedy + sampled

    patch.unpatch()
    untraced = run()
    assert patch.patch()
    try:
        traced = run()
    finally:
        patch.unpatch()
    assert len(finished_requests(memory_recorder)) == 6
    for (text_a, ids_a, scores_a), (text_b, ids_b, scores_b) in zip(untraced, traced):
        assert text_a == text_b
        assert np.array_equal(ids_a, ids_b)
        assert scores_a.tobytes() == scores_b.tobytes()
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 0


def test_a_broken_hook_never_reaches_the_engine(llama_patched, memory_recorder, make_llama, finished_requests,
                                                monkeypatch):
    """If reading logits fails, the engine still returns its result and the error is counted."""
    llm = make_llama()
    expected = llm.create_completion("robust", max_tokens=4, temperature=0.0)["choices"][0]["text"]
    llm.reset()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated instrumentation bug")

    monkeypatch.setattr(llama_patched.sampling, "raw_top2", broken)
    assert llm.create_completion("robust", max_tokens=4, temperature=0.0)["choices"][0]["text"] == expected
    errors = memory_recorder.pipeline.counters["instrumentation_errors"]
    assert errors >= 1
    *_, (attrs, _, _) = finished_requests(memory_recorder)
    assert not attrs[sc.OUTPUT_MARGINS] and attrs[sc.CACHE_RECOMPUTED_TOKENS] > 0  # the rest is still recorded

    llm.reset()
    monkeypatch.setattr(llama_patched.config, "static_config", broken)  # now the request cannot even start
    assert llm.create_completion("robust", max_tokens=4, temperature=0.0)["choices"][0]["text"] == expected
    assert memory_recorder.pipeline.counters["instrumentation_errors"] > errors
