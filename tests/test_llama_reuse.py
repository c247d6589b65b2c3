"""In-context KV prefix reuse as llama.cpp does it, recorded per request.

The story: a multi-turn agent keeps talking to one ``Llama``.  Each turn's
prompt extends the previous context, so llama.cpp keeps the common prefix in
its KV cache and evaluates only the rest.  Every request span must say how
many tokens were reused and recomputed — and agree with an independent
computation of the longest common prefix and with llama.cpp's own
``n_tokens`` bookkeeping.
"""

from __future__ import annotations

from kvtrace import correlate
from kvtrace import semconv as sc


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_reuse(live: list[int], prompt: list[int]) -> tuple[int, int]:
    """(reused, replayed) by llama.cpp's rule: keep the common prefix, but re-evaluate one
    token when the whole prompt is already in the context (its logits must be refreshed)."""
    lcp = common_prefix(live, prompt)
    if lcp == len(prompt) and lcp > 0:
        return lcp - 1, 1
    return lcp, 0


def test_multi_turn_reuse_matches_llama_cpp_bookkeeping(llama_patched, memory_recorder, make_llama,
                                                        finished_requests):
    llm = make_llama()
    base = llm.tokenize(b"The agent reads the task and plans its first step.")
    observation = llm.tokenize(b" Observation: the file was found.", add_bos=False)
    edit = llm.tokenize(b" Rewritten history instead.", add_bos=False)

    prompts, expectations, after = [], [], []
    prompt = base
    for turn in range(5):
        if turn == 3:
            prompt = prompt[: len(base) + 3] + edit  # history edited: only part of the context is reusable
        if turn == 4:
            prompt = live[: len(live) - 2]  # a prefix of the live context: whole prompt cached → one-token replay
        live = llm.input_ids[: llm.n_tokens].tolist()
        expectations.append(expected_reuse(live, prompt) if live else (0, 0))
        prompts.append(list(prompt))
        with correlate(episode_id="agent", turn=turn):
            llm.create_completion(prompt, max_tokens=6, temperature=0.0)
        after.append(llm.n_tokens)
        live = llm.input_ids[: llm.n_tokens].tolist()
        prompt = live + observation  # the next turn extends everything the engine evaluated

    requests = finished_requests(memory_recorder)
    assert len(requests) == 5
    for turn, ((attrs, events, _), prompt, (reused, replayed), n_after) in enumerate(
            zip(requests, prompts, expectations, after)):
        assert attrs[sc.TURN] == turn and attrs[sc.EPISODE_ID] == "agent"
        assert attrs[sc.PROMPT_TOKEN_IDS] == prompt
        assert attrs[sc.CACHE_REUSED_TOKENS] == reused, f"turn {turn}"
        assert attrs[sc.CACHE_REPLAYED_TOKENS] == replayed, f"turn {turn}"
        assert attrs[sc.CACHE_RECOMPUTED_TOKENS] == len(prompt) - reused
        assert attrs[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == reused
        # llama.cpp's own bookkeeping: context = reused + recomputed + every generated token but the last.
        generated = len(attrs[sc.OUTPUT_MARGINS])
        assert n_after == reused + len(prompt) - reused + generated - 1
        assert attrs[sc.CACHE_LAYER] == (sc.LAYER_KV_REUSE if reused else sc.LAYER_NONE)
        # The kept live context is the prompt's own prefix: verified, and no violation recorded.
        assert attrs.get(sc.CACHE_INTEGRITY) == (sc.INTEGRITY_VERIFIED if reused else None)
        assert not [name for name, _ in events if name == sc.EVENT_CACHE_INTEGRITY_VIOLATION]
        block = attrs[sc.PROMPT_BLOCK_SIZE]
        assert attrs[sc.PROMPT_BLOCK_LAYERS] == [
            sc.LAYER_KV_REUSE if (i + 1) * block <= reused else sc.LAYER_NONE for i in range(len(prompt) // block)]
        reuse_events = [e for name, e in events if name == sc.EVENT_CACHE_REUSE]
        if turn == 0:
            assert reuse_events == []
        else:
            (event,) = reuse_events
            assert event[sc.EVENT_TOKENS] == reused
            assert event[sc.EVENT_OUTCOME] == (sc.OUTCOME_HIT if reused else sc.OUTCOME_MISS)
            if replayed:
                assert event[sc.EVENT_REASON] == sc.REASON_REPLAY_LAST_TOKEN
    assert expectations[1][0] > len(base) and expectations[1][1] == 0  # plain extension: everything reused
    assert 0 < expectations[3][0] < len(prompts[3]) - 1  # edited history: partial reuse
    assert expectations[4][1] == 1  # the replay case was exercised
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 0


def test_configuration_is_recorded(llama_patched, memory_recorder, make_llama, finished_requests):
    llm = make_llama(n_batch=32, n_ubatch=16, seed=11)
    llm.create_completion("configuration", max_tokens=2, temperature=0.0, top_k=5, seed=1234)
    ((attrs, _, _),) = finished_requests(memory_recorder)
    import json

    import llama_cpp

    assert attrs[sc.ENGINE_NAME] == "llama_cpp"
    assert attrs[sc.ENGINE_VERSION] == llama_cpp.__version__
    assert attrs[sc.MODEL_WEIGHT_FORMAT] == "F32"
    assert attrs[sc.KV_CACHE_TYPE] == "f16"
    assert len(attrs[sc.MODEL_FINGERPRINT]) == 32
    numerics = json.loads(attrs[sc.NUMERICS_SETTINGS])
    assert (numerics["n_ctx"], numerics["n_batch"], numerics["n_ubatch"]) == (512, 32, 16)
    assert (numerics["n_threads"], numerics["n_threads_batch"]) == (1, 1)
    assert numerics["flash_attn"] == "disabled"
    sampling = json.loads(attrs[sc.SAMPLING_SETTINGS])
    assert sampling["temp"] == 0.0 and sampling["top_k"] == 5 and sampling["seed"] == 1234
    assert attrs[sc.GEN_AI_REQUEST_SEED] == 1234 and attrs[sc.GEN_AI_REQUEST_TOP_K] == 5
    assert attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] == 2
    assert json.loads(attrs[sc.CACHE_SETTINGS])["prompt_cache"] is None


def test_chat_and_streaming_give_one_span_per_call(llama_patched, memory_recorder, make_llama,
                                                   finished_requests):
    llm = make_llama(chat_format="chatml")
    messages = [{"role": "user", "content": "hello there"}]
    reply = llm.create_chat_completion(messages, max_tokens=4, temperature=0.0)
    chunks = list(llm.create_chat_completion(messages, max_tokens=4, temperature=0.0, stream=True))
    streamed = list(llm.create_completion("stream me", max_tokens=5, temperature=0.0, stream=True))
    stream = llm.create_completion("abandon me", max_tokens=8, temperature=0.0, stream=True)
    next(stream)
    next(stream)
    stream.close()  # the consumer goes away mid-stream

    requests = finished_requests(memory_recorder)
    assert [a[sc.GEN_AI_OPERATION] for a, _, _ in requests] == [
        sc.OPERATION_CHAT, sc.OPERATION_CHAT, sc.OPERATION_TEXT_COMPLETION, sc.OPERATION_TEXT_COMPLETION]
    chat, chat_stream, completion_stream, abandoned = (a for a, _, _ in requests)
    assert reply["choices"][0]["finish_reason"] == chat[sc.OUTPUT_FINISH_REASON]
    assert len(chat[sc.OUTPUT_MARGINS]) == reply["usage"]["completion_tokens"]
    # The identical chat prompt is fully cached the second time: one token replayed.
    assert chat_stream[sc.CACHE_REPLAYED_TOKENS] == 1
    assert chat_stream[sc.OUTPUT_TOKEN_IDS] == chat[sc.OUTPUT_TOKEN_IDS]
    assert chunks[-1]["choices"][0]["finish_reason"] == chat_stream[sc.OUTPUT_FINISH_REASON]
    assert streamed[-1]["choices"][0]["finish_reason"] == completion_stream[sc.OUTPUT_FINISH_REASON]
    assert 1 <= len(completion_stream[sc.OUTPUT_MARGINS]) <= 5
    assert abandoned[sc.OUTPUT_FINISH_REASON] == sc.FINISH_CANCELLED
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 0


def test_unpatched_engine_records_nothing(memory_recorder, make_llama, finished_requests):
    from kvtrace.patches import llama_cpp as patch

    patch.patch()
    patch.patch()  # idempotent
    patch.unpatch()
    patch.unpatch()
    llm = make_llama()
    llm.create_completion("quiet", max_tokens=2, temperature=0.0)
    assert finished_requests(memory_recorder) == []
    assert not hasattr(type(llm).sample, "__wrapped__")
