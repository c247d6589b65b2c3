"""The llama.cpp hooks, area by area, on a stand-in engine (tests/unit/fake_llama.py).

Each story drives the stand-in the way llama-cpp-python drives itself and reads the request spans
kvtrace recorded; none needs llama-cpp-python.  The real engine's stories are tests/test_llama_*.py.
"""

from __future__ import annotations

import json
import logging
import types

import numpy as np
import pytest
import wrapt
from fake_llama import DiskCache, FakeLlama, FakeRAMCache, Llama, RAMCache

from kvtrace import correlate
from kvtrace import semconv as sc
from kvtrace.config import LLAMA_REPACK_VARIABLE, Settings, llama_repack
from kvtrace.errors import BadSetting
from kvtrace.patches.hooks import TraceContextMiddleware
from kvtrace.patches.llama_cpp import HOOKS, config, model_load, repack, server
from kvtrace.patches.llama_cpp.prompt_cache import CacheClasses

PROMPT = list(range(1, 41))  # 40 tokens: two whole blocks of 16


@pytest.fixture
def spans(memory_recorder, finished_requests):
    """Callable: every request recorded so far, as (attributes, events by name)."""

    def read():
        out = []
        for attrs, events, _ in finished_requests(memory_recorder):
            by_name: dict[str, list[dict]] = {}
            for name, event in events:
                by_name.setdefault(name, []).append(event)
            out.append((attrs, by_name))
        return out

    return read


def errors(recorder) -> int:
    return recorder.pipeline.counters["instrumentation_errors"]


# --- request: one record per call ---------------------------------------------------------


def test_a_completion_is_one_record_of_its_prompt_and_tokens(memory_recorder, spans):
    result = Llama().create_completion(PROMPT, max_tokens=3)
    ((attrs, events),) = spans()
    assert attrs[sc.GEN_AI_OPERATION] == sc.OPERATION_TEXT_COMPLETION
    assert attrs[sc.PROMPT_TOKEN_IDS] == PROMPT
    assert attrs[sc.OUTPUT_TOKEN_IDS] == result["choices"][0]["tokens"]
    assert attrs[sc.OUTPUT_FINISH_REASON] == "length" and attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] == 3
    assert attrs[sc.CACHE_LAYER] == sc.LAYER_NONE and attrs[sc.CACHE_RECOMPUTED_TOKENS] == len(PROMPT)
    assert events == {}  # an empty context: nothing to reuse, nothing to report
    assert errors(memory_recorder) == 0


def test_a_chat_completion_is_one_record_though_it_calls_create_completion(spans):
    Llama().create_chat_completion([PROMPT[:10], PROMPT[10:]], max_tokens=2)
    ((attrs, _),) = spans()
    assert attrs[sc.GEN_AI_OPERATION] == sc.OPERATION_CHAT and attrs[sc.PROMPT_TOKEN_IDS] == PROMPT


def test_a_stream_is_recorded_step_by_step_and_an_early_close_is_cancelled(spans):
    llm = Llama()
    full = [chunk["choices"][0]["token"] for chunk in llm.create_completion(PROMPT, max_tokens=4, stream=True)]
    llm.reset()
    stream = llm.create_completion(PROMPT, max_tokens=4, stream=True)
    taken = [next(stream)["choices"][0]["token"] for _ in range(2)]
    stream.close()
    (whole, _), (closed, _) = spans()
    assert whole[sc.OUTPUT_TOKEN_IDS] == full and whole[sc.OUTPUT_FINISH_REASON] == "length"
    assert closed[sc.OUTPUT_TOKEN_IDS] == taken == full[:2]
    assert closed[sc.OUTPUT_FINISH_REASON] == sc.FINISH_CANCELLED


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_reaches_the_caller_unchanged_and_is_on_the_record(stream, memory_recorder, finished_requests):
    llm = Llama()
    with pytest.raises(RuntimeError, match="decode failed"):
        result = llm.create_completion(PROMPT, max_tokens=4, stream=stream, fail_after=2)
        list(result)
    ((attrs, _, span),) = finished_requests(memory_recorder)
    assert span.status.description == "RuntimeError: decode failed"
    assert len(attrs[sc.OUTPUT_TOKEN_IDS]) == 2  # the tokens sampled before the engine failed


def test_hooks_outside_a_recorded_call_only_pass_through(memory_recorder, spans):
    traced, untraced = Llama().generate(PROMPT), FakeLlama().generate(PROMPT)
    assert [next(traced) for _ in range(3)] == [next(untraced) for _ in range(3)]
    assert spans() == [] and errors(memory_recorder) == 0


# --- reuse: generate / eval ---------------------------------------------------------------


def test_a_prompt_that_extends_the_live_context_reuses_all_of_it(spans):
    llm = Llama()
    llm.create_completion(PROMPT, max_tokens=4)
    live = llm.input_ids.tolist()  # the prompt and every generated token but the last
    llm.create_completion(live + [7, 8], max_tokens=2)
    _, (attrs, events) = spans()
    assert attrs[sc.CACHE_REUSED_TOKENS] == len(live) and attrs[sc.CACHE_RECOMPUTED_TOKENS] == 2
    assert attrs[sc.CACHE_REPLAYED_TOKENS] == 0 and attrs[sc.CACHE_LAYER] == sc.LAYER_KV_REUSE
    (reuse,) = events[sc.EVENT_CACHE_REUSE]
    assert reuse[sc.EVENT_OUTCOME] == sc.OUTCOME_HIT and reuse[sc.EVENT_TOKENS] == reuse[sc.EVENT_PREFIX_TOKENS] == len(live)
    assert sc.EVENT_REASON not in reuse


def test_a_whole_prompt_match_replays_its_last_token(spans):
    llm = Llama()
    llm.create_completion(PROMPT, max_tokens=4)
    llm.create_completion(PROMPT, max_tokens=4)
    _, (attrs, events) = spans()
    assert attrs[sc.CACHE_REUSED_TOKENS] == len(PROMPT) - 1 and attrs[sc.CACHE_RECOMPUTED_TOKENS] == 1
    assert attrs[sc.CACHE_REPLAYED_TOKENS] == 1
    (reuse,) = events[sc.EVENT_CACHE_REUSE]
    assert reuse[sc.EVENT_REASON] == sc.REASON_REPLAY_LAST_TOKEN and reuse[sc.EVENT_PREFIX_TOKENS] == len(PROMPT)


def test_an_edited_history_reuses_the_common_prefix_and_the_blocks_inside_it(spans):
    llm = Llama()
    llm.create_completion(PROMPT, max_tokens=4)
    edited = PROMPT[:20] + [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]
    llm.create_completion(edited, max_tokens=2)
    _, (attrs, events) = spans()
    assert attrs[sc.CACHE_REUSED_TOKENS] == 20 and attrs[sc.CACHE_RECOMPUTED_TOKENS] == len(edited) - 20
    assert attrs[sc.PROMPT_BLOCK_LAYERS] == [sc.LAYER_KV_REUSE, sc.LAYER_NONE]  # 16 ≤ 20 < 32
    assert events[sc.EVENT_CACHE_REUSE][0][sc.EVENT_PREFIX_TOKENS] == 20


def test_a_prompt_that_shares_nothing_with_the_live_context_is_a_miss(spans):
    llm = Llama()
    llm.create_completion(PROMPT, max_tokens=2)
    llm.create_completion([63] + PROMPT[1:], max_tokens=2)
    _, (attrs, events) = spans()
    assert attrs[sc.CACHE_REUSED_TOKENS] == 0 and attrs[sc.CACHE_LAYER] == sc.LAYER_NONE
    (reuse,) = events[sc.EVENT_CACHE_REUSE]
    assert reuse[sc.EVENT_OUTCOME] == sc.OUTCOME_MISS and reuse[sc.EVENT_LAYER] == sc.LAYER_KV_REUSE


def test_the_sampling_parameters_handed_to_the_sampler_are_recorded(spans):
    Llama().create_completion(PROMPT, max_tokens=1, temperature=0.25)
    ((attrs, _),) = spans()
    assert attrs[sc.GEN_AI_REQUEST_TEMPERATURE] == 0.25 and attrs[sc.GEN_AI_REQUEST_TOP_K] == 40
    assert attrs[sc.GEN_AI_REQUEST_SEED] == 1234
    sampling = json.loads(attrs[sc.SAMPLING_SETTINGS])
    assert sampling["repeat_penalty"] == 1.0 and sampling["penalty_last_n"] == 64 and sampling["grammar"] is False


def test_eval_is_watched_only_until_the_prompt_is_evaluated(spans):
    """``eval`` runs once per token, so it is not wrapped: the first one is caught from ``generate``."""
    llm = Llama()
    evals = []
    engine_eval = llm.eval

    def counting_eval(tokens):  # the user's own instance-level eval, kept through the request
        evals.append(list(tokens))
        return engine_eval(tokens)

    llm.eval = counting_eval
    tokens = llm.create_completion(PROMPT, max_tokens=4)["choices"][0]["tokens"]
    ((attrs, _),) = spans()
    assert attrs[sc.CACHE_RECOMPUTED_TOKENS] == len(PROMPT) and attrs[sc.CACHE_REUSED_TOKENS] == 0
    assert evals == [PROMPT] + [[t] for t in tokens[:-1]]  # every eval reached the user's, once
    assert vars(llm)["eval"] is counting_eval and type(llm).eval is FakeLlama.eval  # nothing of kvtrace's left


def test_a_request_that_ends_before_the_engine_evaluates_leaves_eval_as_it_was(memory_recorder):
    from kvtrace.patches.llama_cpp import request, reuse
    from kvtrace.patches.llama_cpp.calls import CALLS

    llm = Llama()
    state = request.begin(llm, sc.OPERATION_TEXT_COMPLETION, {})
    token = CALLS.bind(state)
    try:
        llm.generate(PROMPT)  # a generator: its body, and so the first eval, has not run
        assert isinstance(vars(llm)["eval"], reuse.FirstEvalWatch)
    finally:
        CALLS.unbind(token)
    request.end(state, error=RuntimeError("cancelled before decoding"))
    assert "eval" not in vars(llm) and state.unwatch_eval is None
    assert errors(memory_recorder) == 0


# --- sampling: top-two margins --------------------------------------------------------------


def test_each_token_records_the_raw_top_two_margin_and_logprob(spans):
    llm = Llama()
    tokens = llm.create_completion(PROMPT, max_tokens=3)["choices"][0]["tokens"]
    ((attrs, _),) = spans()
    for step, previous in enumerate([PROMPT[-1]] + tokens[:-1]):
        row = llm.table[previous].astype(np.float64)
        top1, runner_up = np.argsort(-row, kind="stable")[:2]
        assert attrs[sc.OUTPUT_TOP1_IDS][step] == top1 and attrs[sc.OUTPUT_RUNNER_UP_IDS][step] == runner_up
        assert attrs[sc.OUTPUT_MARGINS][step] == pytest.approx(row[top1] - row[runner_up], abs=1e-6)
        log_softmax = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert attrs[sc.OUTPUT_LOGPROBS][step] == pytest.approx(log_softmax[tokens[step]], abs=1e-5)


def test_equal_top_logits_give_a_zero_margin_and_the_lower_id_wins(spans):
    llm = Llama()
    llm.table[PROMPT[-1]] = 0.0
    llm.table[PROMPT[-1], [9, 4]] = 3.0
    llm.create_completion(PROMPT, max_tokens=1)
    ((attrs, _),) = spans()
    assert attrs[sc.OUTPUT_TOP1_IDS] == [4] and attrs[sc.OUTPUT_RUNNER_UP_IDS] == [9]
    assert list(attrs[sc.OUTPUT_MARGINS]) == [0.0]


def test_unreadable_logits_leave_the_engines_tokens_alone(memory_recorder, spans):
    expected = FakeLlama().create_completion(PROMPT, max_tokens=3)
    llm = Llama()
    llm.no_logits = True  # get_logits_ith gives NULL
    assert llm.create_completion(PROMPT, max_tokens=3) == expected
    ((attrs, _),) = spans()
    assert not attrs[sc.OUTPUT_MARGINS] and attrs[sc.CACHE_RECOMPUTED_TOKENS] == len(PROMPT)
    assert errors(memory_recorder) >= 1


def test_a_token_the_logits_cannot_explain_fails_only_the_observation(memory_recorder, spans):
    untraced, llm = FakeLlama(), Llama()
    untraced.sampled_offset = llm.sampled_offset = 1000  # outside the logits row: the record step raises
    assert llm.create_completion(PROMPT, max_tokens=1) == untraced.create_completion(PROMPT, max_tokens=1)
    ((attrs, _),) = spans()
    assert not attrs[sc.OUTPUT_MARGINS] and errors(memory_recorder) >= 1


# --- prompt cache: lookup, restore, store, evict ---------------------------------------------


def test_a_lookup_in_an_empty_cache_is_a_miss_and_the_engine_still_sees_key_error(spans):
    with pytest.raises(KeyError):
        RAMCache()[PROMPT]  # outside a request: the engine's own behaviour
    llm = Llama()
    llm.cache = RAMCache()
    llm.create_completion(PROMPT, max_tokens=2)  # the engine catches the KeyError of a miss
    ((attrs, events),) = spans()
    (lookup,) = events[sc.EVENT_CACHE_LOOKUP]
    assert lookup[sc.EVENT_OUTCOME] == sc.OUTCOME_MISS and lookup[sc.EVENT_TOKENS] == len(PROMPT)
    assert lookup[sc.EVENT_ENTRIES_SCANNED] == 0
    (store,) = events[sc.EVENT_CACHE_STORE]
    assert store[sc.EVENT_OUTCOME] == sc.OUTCOME_STORED and store[sc.EVENT_TOKENS] == len(PROMPT) + 2


def test_a_restored_state_names_the_request_that_stored_it(spans):
    cache = RAMCache()
    first, second = Llama(), Llama()
    first.cache = second.cache = cache
    with correlate(episode_id="writer", turn=0):
        written = first.create_completion(PROMPT, max_tokens=3)["choices"][0]["tokens"]
    with correlate(episode_id="reader", turn=0):
        second.create_completion(PROMPT + [written[0] + 1], max_tokens=2)  # shares the prompt, not the answer
    (stored, _), (attrs, events) = spans()
    (lookup,) = events[sc.EVENT_CACHE_LOOKUP]
    (restore,) = events[sc.EVENT_CACHE_RESTORE]
    assert lookup[sc.EVENT_OUTCOME] == sc.OUTCOME_HIT and lookup[sc.EVENT_PREFIX_TOKENS] == len(PROMPT)
    assert lookup[sc.EVENT_KEY_HASH] == restore[sc.EVENT_KEY_HASH] == attrs[sc.CACHE_STATE_KEY]
    assert restore[sc.EVENT_TOKENS] == len(PROMPT) + 2  # the writer's context: prompt and all but its last token
    for origin in (restore, attrs):
        assert origin[sc.CACHE_SOURCE_REQUEST_ID] == stored[sc.REQUEST_ID]
        assert origin[sc.CACHE_SOURCE_EPISODE_ID] == "writer"
    assert attrs[sc.CACHE_LAYER] == sc.LAYER_PROMPT_CACHE and attrs[sc.CACHE_REUSED_TOKENS] == len(PROMPT)


def test_a_full_cache_evicts_the_oldest_state_and_names_who_stored_it(spans):
    cache = RAMCache(capacity_bytes=150)  # room for one 100-byte state
    first, second = Llama(), Llama()
    first.cache = second.cache = cache
    first.create_completion(PROMPT, max_tokens=2)
    second.create_completion([60, 61, 62], max_tokens=2)
    (stored, first_events), (_, events) = spans()
    (evict,) = events[sc.EVENT_CACHE_EVICT]
    assert evict[sc.EVENT_REASON] == sc.REASON_CAPACITY and evict[sc.EVENT_SIZE_BYTES] == 100
    assert evict[sc.EVENT_KEY_HASH] == first_events[sc.EVENT_CACHE_STORE][0][sc.EVENT_KEY_HASH]
    assert evict[sc.CACHE_SOURCE_REQUEST_ID] == stored[sc.REQUEST_ID]
    assert events[sc.EVENT_CACHE_LOOKUP][0][sc.EVENT_ENTRIES_SCANNED] == 1


def test_a_state_larger_than_the_cache_is_evicted_as_it_is_stored(spans):
    llm = Llama()
    llm.cache = RAMCache(capacity_bytes=50)
    llm.create_completion(PROMPT, max_tokens=2)
    ((_, events),) = spans()
    assert [e[sc.EVENT_OUTCOME] for e in events[sc.EVENT_CACHE_STORE]] == [sc.OUTCOME_EVICTED_IMMEDIATELY]
    assert sc.EVENT_CACHE_EVICT not in events  # the new state itself is not an eviction of an older one


def test_a_disk_cache_lookup_takes_the_state_out_of_the_cache(spans):
    cache = DiskCache()
    first, second = Llama(), Llama()
    first.cache = second.cache = cache
    first.create_completion(PROMPT, max_tokens=2)
    second.create_completion(PROMPT, max_tokens=2)
    (stored, _), (_, events) = spans()
    taken = [e for e in events[sc.EVENT_CACHE_EVICT] if e[sc.EVENT_REASON] == sc.REASON_TAKEN_ON_LOOKUP]
    assert len(taken) == 1 and taken[0][sc.CACHE_SOURCE_REQUEST_ID] == stored[sc.REQUEST_ID]


def test_a_users_cache_subclass_calling_super_is_one_lookup_and_one_store(spans):
    class UserCache(RAMCache):
        def __getitem__(self, key):
            return super().__getitem__(key)

        def __setitem__(self, key, value):
            super().__setitem__(key, value)

    original = UserCache.__dict__["__getitem__"]
    classes = CacheClasses()
    classes.cover(UserCache)  # not installed: nothing is wrapped
    assert UserCache.__dict__["__getitem__"] is original
    classes.install()
    classes.cover(UserCache)
    try:
        llm = Llama()
        llm.cache = UserCache()
        llm.create_completion(PROMPT, max_tokens=2)
        llm.create_completion(PROMPT + [60], max_tokens=2)
    finally:
        classes.restore()
    assert UserCache.__dict__["__getitem__"] is original
    _, (_, events) = spans()
    assert len(events[sc.EVENT_CACHE_LOOKUP]) == len(events[sc.EVENT_CACHE_STORE]) == 1


# --- config: what the Llama is configured with ------------------------------------------------


def configured_llama(model_path: str, file_type: str = "7"):
    params = types.SimpleNamespace(type_k=1, type_v=0, n_ubatch=64, n_threads=2, n_threads_batch=2,
                                   flash_attn_type=-1, offload_kqv=True)
    return types.SimpleNamespace(model_path=model_path, metadata={"general.file_type": file_type},
                                 context_params=params, n_ctx=lambda: 512, n_batch=64, _logits_all=False,
                                 model_params=types.SimpleNamespace(n_gpu_layers=0, use_extra_bufts=False))


def test_the_static_config_is_computed_once_per_llama(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "llama_system_info", lambda: "CPU : AVX2 = 1")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    llama = configured_llama(str(model))
    first = config.static_config(llama)
    assert first[sc.MODEL_WEIGHT_FORMAT] == "Q8_0" and first[sc.KV_CACHE_TYPE] == "f16/f32"
    numerics = first[sc.NUMERICS_SETTINGS]
    assert numerics["flash_attn"] == "auto" and numerics["weight_repack"] is False
    assert numerics["system_info"] == "CPU : AVX2 = 1"
    monkeypatch.setattr(config, "llama_system_info", lambda: "changed")
    second = config.static_config(llama)
    assert second == first and second is not first  # cached on the Llama; each record gets its own copy


def test_the_fingerprint_tells_apart_weights_that_differ_only_in_their_tail(tmp_path):
    a, b, c = (tmp_path / name for name in ("a", "b", "c"))
    a.write_bytes(b"\0" * 100_000 + b"x")
    b.write_bytes(b"\0" * 100_000 + b"y")
    c.write_bytes(b"\0" * 100_000 + b"x")
    metadata = {"general.architecture": "llama"}
    assert config.fingerprint(str(a), metadata) == config.fingerprint(str(c), metadata)
    assert config.fingerprint(str(a), metadata) != config.fingerprint(str(b), metadata)
    assert config.fingerprint(str(tmp_path / "gone"), metadata) != config.fingerprint(str(a), metadata)
    assert config.weight_format({}) == "unknown"


def test_the_cache_settings_are_the_caches_of_the_llama_now():
    llm = Llama()
    assert config.cache_settings(llm) == {"kv_reuse": True, "prompt_cache": None}
    llm.cache = FakeRAMCache(capacity_bytes=4096)
    assert config.cache_settings(llm)["capacity_bytes"] == 4096
    assert config.model_name(llm, {}) == "fake-F32.gguf" and config.model_name(llm, {"model": "alias"}) == "alias"


# --- model load: KVTRACE_LLAMA_REPACK and the Intel AMX warning --------------------------------

AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
NON_AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n"
FILE_TYPES = {"F32": "0", "F16": "1", "BF16": "32", "Q4_0": "2", "Q8_0": "7", "Q4_K_M": "15"}


class LoadingLlama:
    """What ``Llama.__init__`` leaves behind that the load hook reads: the model's path, its GGUF
    metadata and the ``model_params`` it loaded with (``use_extra_bufts``: the repack)."""

    def __init__(self, model_path: str, weights: str = "Q4_0", use_extra_bufts: bool = True,
                 vocab_only: bool = False):
        self.model_path = model_path
        self.metadata = {"general.file_type": FILE_TYPES[weights]}
        self.model_params = types.SimpleNamespace(use_extra_bufts=use_extra_bufts, vocab_only=vocab_only)


(LOAD_HOOK,) = [hook for hook in HOOKS.hooks if hook.target == "Llama.__init__"]
HookedLoadingLlama = type("LoadingLlama", (LoadingLlama,),
                          {"__init__": wrapt.FunctionWrapper(LoadingLlama.__init__, LOAD_HOOK.wrapper)})


@pytest.fixture
def cpu(monkeypatch):
    """Set the CPU the load hook sees, as ``/proc/cpuinfo``'s text; starts each test with nothing warned."""
    model_load.NOTICES.forget()
    monkeypatch.delenv(LLAMA_REPACK_VARIABLE, raising=False)

    def use(cpuinfo: str) -> None:
        monkeypatch.setattr(repack, "_proc_cpuinfo", lambda: cpuinfo)

    yield use
    model_load.NOTICES.forget()


def amx_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "Intel AMX" in record.getMessage()]


@pytest.mark.parametrize("cpuinfo, weights, use_extra_bufts, warned", [
    (AMX_CPU, "Q4_0", True, True),
    (AMX_CPU, "Q8_0", True, True),
    (AMX_CPU, "Q4_K_M", True, True),
    (AMX_CPU, "F32", True, False),  # F32 / F16 / BF16 weights are not repacked
    (AMX_CPU, "F16", True, False),
    (AMX_CPU, "BF16", True, False),
    (AMX_CPU, "Q4_0", False, False),  # loaded with the repack off
    (NON_AMX_CPU, "Q4_0", True, False),
])
def test_a_quantized_model_loaded_with_the_repack_on_an_amx_cpu_is_warned_about(cpu, caplog, cpuinfo, weights,
                                                                                use_extra_bufts, warned):
    cpu(cpuinfo)
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        llm = HookedLoadingLlama(f"/models/tiny-{weights}.gguf", weights, use_extra_bufts=use_extra_bufts)
    assert llm.model_params.use_extra_bufts is use_extra_bufts  # the user's load, untouched
    if not warned:
        assert amx_warnings(caplog) == []
        return
    (message,) = amx_warnings(caplog)
    assert f"/models/tiny-{weights}.gguf is quantized ({weights})" in message
    assert "load_llama" in message and "KVTRACE_LLAMA_REPACK=off" in message and "#20824" in message
    assert "\n" not in message


def test_the_warning_is_said_once_per_model_file(cpu, caplog):
    cpu(AMX_CPU)
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        for path in ("/models/a-Q4_0.gguf", "/models/a-Q4_0.gguf", "/models/b-Q8_0.gguf", "/models/a-Q4_0.gguf"):
            HookedLoadingLlama(path)
    assert [message.split(" is quantized")[0] for message in amx_warnings(caplog)] == [
        "kvtrace: /models/a-Q4_0.gguf", "kvtrace: /models/b-Q8_0.gguf"]


def test_loads_that_cannot_crash_in_decode_are_not_warned_about(cpu, caplog):
    cpu(AMX_CPU)
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        HookedLoadingLlama("/models/vocab-Q4_0.gguf", vocab_only=True)  # no weights loaded
        with repack.REPACK.choose(True):  # kvtrace's own load_llama(weight_repack=True) chose it on purpose
            HookedLoadingLlama("/models/chosen-Q4_0.gguf")
        stand_in = Llama()  # the hooked stand-in engine: its params say nothing about the repack
    assert amx_warnings(caplog) == [] and stand_in.n_tokens == 0


def test_the_repack_setting_is_off_or_default_and_anything_else_is_refused_in_one_line():
    assert llama_repack({}) == "default" and llama_repack({LLAMA_REPACK_VARIABLE: ""}) == "default"
    assert llama_repack({LLAMA_REPACK_VARIABLE: " OFF "}) == "off"
    assert llama_repack({LLAMA_REPACK_VARIABLE: "default"}) == "default"
    with pytest.raises(BadSetting) as refused:
        llama_repack({LLAMA_REPACK_VARIABLE: "no"})
    assert str(refused.value) == ("KVTRACE_LLAMA_REPACK='no' is not one of default, off; "
                                  "unset it for the default (default)")
    with pytest.raises(BadSetting, match="KVTRACE_LLAMA_REPACK"):  # what `kvtrace run` checks before it starts
        Settings.from_env({"KVTRACE_HASH_KEY": "test-deployment-key", LLAMA_REPACK_VARIABLE: "false"})


def test_a_bad_repack_setting_in_an_instrumented_engine_is_said_once_and_loads_as_the_code_asks(
        cpu, caplog, monkeypatch, memory_recorder):
    cpu(NON_AMX_CPU)
    monkeypatch.setenv(LLAMA_REPACK_VARIABLE, "disabled")
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        first, second = HookedLoadingLlama("/models/a-Q4_0.gguf"), HookedLoadingLlama("/models/b-Q4_0.gguf")
    assert first.model_params.use_extra_bufts is second.model_params.use_extra_bufts is True
    refusals = [record.getMessage() for record in caplog.records if LLAMA_REPACK_VARIABLE in record.getMessage()]
    assert refusals == ["kvtrace: KVTRACE_LLAMA_REPACK='disabled' is not one of default, off; unset it for the "
                        "default (default); models load as the code asks"]
    assert errors(memory_recorder) == 0


# --- server: trace context per HTTP request ---------------------------------------------------


class App:
    def __init__(self):
        self.middleware = []

    def add_middleware(self, cls, **options):
        self.middleware.append(cls)


def test_the_server_app_gets_the_trace_context_middleware_once():
    app = server.create_app_wrapper(App, None, (), {})
    assert app.middleware == [TraceContextMiddleware]
    server.create_app_wrapper(lambda: app, None, (), {})
    assert app.middleware == [TraceContextMiddleware]


def test_an_app_that_refuses_the_middleware_is_still_served(memory_recorder):
    class Refusing(App):
        def add_middleware(self, cls, **options):
            raise RuntimeError("no middleware after start")

    app = server.create_app_wrapper(Refusing, None, (), {})
    assert isinstance(app, Refusing) and errors(memory_recorder) == 1
