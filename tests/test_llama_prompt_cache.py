"""The host prompt cache: which earlier request's state a restore brought back.

The story: a server interleaves two agent episodes on one ``Llama`` with a
``LlamaRAMCache``.  When episode A comes back after B ran, its live context
is gone, and llama.cpp restores the state A's previous turn stored.  The span
must name that request (span, episode, turn) as the source; stores and
evictions must appear as cache events with consistent key hashes.
"""

from __future__ import annotations

import llama_cpp

from kvtrace import correlate
from kvtrace import semconv as sc


def events_named(events, name):
    return [attrs for event_name, attrs in events if event_name == name]


def run_turn(llm, prompt, episode, turn, max_tokens=6):
    with correlate(episode_id=episode, turn=turn):
        llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
    return llm.input_ids[: llm.n_tokens].tolist()


def test_interleaved_episodes_restore_names_the_storing_request(llama_patched, memory_recorder, make_llama,
                                                                finished_requests):
    llm = make_llama()
    llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=50 << 20))
    obs = llm.tokenize(b" next observation", add_bos=False)
    prompt_a = llm.tokenize(b"Episode A: the robot walks to the kitchen and")
    prompt_b = llm.tokenize(b"Episode B: a completely different question about")

    context_a0 = run_turn(llm, prompt_a, "A", 0)
    context_b0 = run_turn(llm, prompt_b, "B", 0)
    run_turn(llm, context_a0 + obs, "A", 1)
    run_turn(llm, context_b0 + obs, "B", 1)

    (a0, ev_a0, span_a0), (b0, ev_b0, span_b0), (a1, ev_a1, _), (b1, ev_b1, _) = finished_requests(memory_recorder)

    # Turn 0 of A: empty cache.
    assert [e[sc.EVENT_OUTCOME] for e in events_named(ev_a0, sc.EVENT_CACHE_LOOKUP)] == [sc.OUTCOME_MISS]
    (store_a0,) = events_named(ev_a0, sc.EVENT_CACHE_STORE)
    assert store_a0[sc.EVENT_TOKENS] == len(prompt_a) + len(a0[sc.OUTPUT_MARGINS])
    assert store_a0[sc.EVENT_SIZE_BYTES] > 0

    # A comes back after B: its state is restored from the prompt cache, stored by A's turn 0.
    assert a1[sc.CACHE_LAYER] == sc.LAYER_PROMPT_CACHE
    assert a1[sc.CACHE_REUSED_TOKENS] == len(context_a0)
    assert a1[sc.CACHE_RECOMPUTED_TOKENS] == len(obs)
    assert a1[sc.CACHE_STATE_KEY] == store_a0[sc.EVENT_KEY_HASH]
    assert a1[sc.CACHE_SOURCE_SPAN_ID] == "%016x" % span_a0.context.span_id
    assert a1[sc.CACHE_SOURCE_TRACE_ID] == "%032x" % span_a0.context.trace_id
    assert (a1[sc.CACHE_SOURCE_EPISODE_ID], a1[sc.CACHE_SOURCE_TURN]) == ("A", 0)
    assert a1[sc.CACHE_SOURCE_RUN_ID] == a0[sc.RUN_ID]
    (lookup,) = events_named(ev_a1, sc.EVENT_CACHE_LOOKUP)
    assert lookup[sc.EVENT_OUTCOME] == sc.OUTCOME_HIT
    assert lookup[sc.EVENT_ENTRIES_SCANNED] == 2
    assert lookup[sc.EVENT_PREFIX_TOKENS] >= len(context_a0)  # key = prompt + every generated token
    (restore,) = events_named(ev_a1, sc.EVENT_CACHE_RESTORE)
    assert restore[sc.EVENT_KEY_HASH] == store_a0[sc.EVENT_KEY_HASH]
    assert restore[sc.EVENT_SOURCE_SPAN_ID] == a1[sc.CACHE_SOURCE_SPAN_ID]
    assert restore[sc.EVENT_TOKENS] == len(context_a0)
    assert a1[sc.PROMPT_BLOCK_LAYERS][0] == sc.LAYER_PROMPT_CACHE
    assert a1[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VERIFIED  # the restored state's tokens are A's prompt prefix
    assert not events_named(ev_a1, sc.EVENT_CACHE_INTEGRITY_VIOLATION)
    # The same for B, whose state was stored by B's turn 0.
    assert b1[sc.CACHE_LAYER] == sc.LAYER_PROMPT_CACHE
    assert (b1[sc.CACHE_SOURCE_EPISODE_ID], b1[sc.CACHE_SOURCE_TURN]) == ("B", 0)
    assert b1[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VERIFIED
    assert b1[sc.CACHE_SOURCE_SPAN_ID] == "%016x" % span_b0.context.span_id
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 0


def test_skipped_lookup_when_live_context_is_longer(llama_patched, memory_recorder, make_llama,
                                                    finished_requests):
    llm = make_llama()
    llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=50 << 20))
    obs = llm.tokenize(b" and more", add_bos=False)
    context = run_turn(llm, llm.tokenize(b"A single conversation continues"), "solo", 0)
    run_turn(llm, context + obs, "solo", 1)
    _, (second, events, _) = finished_requests(memory_recorder)
    (lookup,) = events_named(events, sc.EVENT_CACHE_LOOKUP)
    assert lookup[sc.EVENT_OUTCOME] == sc.OUTCOME_SKIPPED  # found, but the live context covers as much
    assert events_named(events, sc.EVENT_CACHE_RESTORE) == []
    assert second[sc.CACHE_LAYER] == sc.LAYER_KV_REUSE
    assert sc.CACHE_SOURCE_SPAN_ID not in second


def test_small_capacity_evicts_and_evictions_carry_provenance(llama_patched, memory_recorder, make_llama,
                                                              finished_requests):
    llm = make_llama()
    state_bytes = None
    llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=1 << 30))
    run_turn(llm, llm.tokenize(b"measure one state"), "probe", 0)
    ((_, events, _),) = finished_requests(memory_recorder)
    state_bytes = events_named(events, sc.EVENT_CACHE_STORE)[0][sc.EVENT_SIZE_BYTES]
    memory_recorder.pipeline.exporter.clear()

    cache = llama_cpp.LlamaRAMCache(capacity_bytes=int(state_bytes * 2.5))  # room for about two states
    llm.set_cache(cache)
    for episode in range(5):
        run_turn(llm, llm.tokenize(f"Episode number {episode} starts with a distinct prompt".encode()), str(episode), 0)
    requests = finished_requests(memory_recorder)
    stores = [(attrs, events_named(events, sc.EVENT_CACHE_STORE)[0]) for attrs, events, _ in requests]
    evictions = [e for _, events, _ in requests for e in events_named(events, sc.EVENT_CACHE_EVICT)]
    assert len(evictions) >= 2
    assert len(cache.cache_state) + len(evictions) == len(stores)
    stored_by = {store[sc.EVENT_KEY_HASH]: attrs for attrs, store in stores}
    for eviction in evictions:
        assert eviction[sc.EVENT_REASON] == sc.REASON_CAPACITY
        origin = stored_by[eviction[sc.EVENT_KEY_HASH]]  # only states that were stored get evicted
        assert eviction[sc.EVENT_SOURCE_EPISODE_ID] == origin[sc.EPISODE_ID]
        assert eviction[sc.EVENT_SIZE_BYTES] > 0
    # LRU: the oldest episodes go first.
    assert [stored_by[e[sc.EVENT_KEY_HASH]][sc.EPISODE_ID] for e in evictions] == [
        str(i) for i in range(len(evictions))]


def test_disk_cache_hands_out_entries_and_loses_them_on_skipped_lookups(
        llama_patched, memory_recorder, make_llama, finished_requests, tmp_path):
    """LlamaDiskCache pops the entry a lookup selects, even when it is not restored: the trace shows it."""
    llm = make_llama()
    llm.set_cache(llama_cpp.LlamaDiskCache(cache_dir=str(tmp_path / "disk-cache"), capacity_bytes=50 << 20))
    obs = llm.tokenize(b" next", add_bos=False)
    context_a = run_turn(llm, llm.tokenize(b"Disk episode A begins here"), "A", 0)
    llm.reset()  # the live context is gone (as after a restart with a persistent disk cache)
    run_turn(llm, context_a + obs, "A", 1)
    run_turn(llm, llm.tokenize(b"Disk episode B is something else"), "B", 0)
    (_, a0_events, _), (a1, a1_events, span_a1), (b0, b0_events, _) = finished_requests(memory_recorder)

    (store_a0,) = events_named(a0_events, sc.EVENT_CACHE_STORE)
    assert a1[sc.CACHE_LAYER] == sc.LAYER_PROMPT_CACHE
    assert a1[sc.CACHE_REUSED_TOKENS] == len(context_a)
    assert (a1[sc.CACHE_SOURCE_EPISODE_ID], a1[sc.CACHE_SOURCE_TURN]) == ("A", 0)
    assert a1[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VERIFIED  # an unpickled state: its own input_ids compared
    (taken,) = events_named(a1_events, sc.EVENT_CACHE_EVICT)
    assert taken[sc.EVENT_REASON] == sc.REASON_TAKEN_ON_LOOKUP
    assert taken[sc.EVENT_KEY_HASH] == a1[sc.CACHE_STATE_KEY] == store_a0[sc.EVENT_KEY_HASH]

    # B's lookup selects A's newer state (common BOS), does not restore it, and the disk cache drops it.
    (lookup,) = events_named(b0_events, sc.EVENT_CACHE_LOOKUP)
    assert lookup[sc.EVENT_OUTCOME] == sc.OUTCOME_SKIPPED
    (lost,) = events_named(b0_events, sc.EVENT_CACHE_EVICT)
    assert lost[sc.EVENT_REASON] == sc.REASON_TAKEN_ON_LOOKUP
    assert lost[sc.EVENT_SOURCE_SPAN_ID] == "%016x" % span_a1.context.span_id
    assert b0[sc.CACHE_LAYER] != sc.LAYER_PROMPT_CACHE


def test_user_defined_cache_subclass_is_instrumented(llama_patched, memory_recorder, make_llama,
                                                     finished_requests):
    class CountingCache(llama_cpp.LlamaRAMCache):
        lookups = 0

        def __getitem__(self, key):
            CountingCache.lookups += 1
            return super().__getitem__(key)

    llm = make_llama()
    llm.set_cache(CountingCache(capacity_bytes=50 << 20))
    obs = llm.tokenize(b" again", add_bos=False)
    context_a = run_turn(llm, llm.tokenize(b"Subclass episode A"), "A", 0)
    run_turn(llm, llm.tokenize(b"Subclass episode B differs"), "B", 0)
    run_turn(llm, context_a + obs, "A", 1)
    *_, (a1, events, _) = finished_requests(memory_recorder)
    assert CountingCache.lookups == 3
    assert len(events_named(events, sc.EVENT_CACHE_LOOKUP)) == 1  # super() call not counted twice
    assert a1[sc.CACHE_SOURCE_EPISODE_ID] == "A"
