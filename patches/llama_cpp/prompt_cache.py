"""The host prompt cache: lookups, restores, stores and evictions, each with the state's origin.

``_create_completion`` looks the prompt up (``cache[prompt_tokens]`` → ``__getitem__`` →
``_find_longest_prefix_key``; ``KeyError`` is a miss), restores the state it found with
``Llama.load_state`` when it beats the live context, and after generation stores
``cache[prompt + completion] = save_state()``.  ``LlamaRAMCache`` evicts inside ``__setitem__``;
``LlamaDiskCache.__getitem__`` pops the entry it returns.  Which request stored each entry is
kept per cache object, so a restore or an eviction names the request whose state it was; the
tokens a restored state holds are checked against the prompt at its first eval (:mod:`.reuse`).

Dunder methods are looked up on the type, so they are wrapped on the class that defines them:
the built-in caches through the package's hook table, a user's subclass (which may override
them and call ``super()``) by :data:`CACHE_CLASSES` when a request first meets it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Optional, Sequence

from kvtrace import semconv as sc
from kvtrace.patches.hooks import Wrappings, is_wrapped
from kvtrace.patches.llama_cpp.calls import CALLS, CallState
from kvtrace.patches.llama_cpp.engine import FAILURES
from kvtrace.patches.llama_cpp.reuse import common_prefix
from kvtrace.recording.records import CacheEvent, StateOrigin

CACHE_MODULE = "llama_cpp.llama_cache"
BUILT_IN_CACHES = ("LlamaRAMCache", "LlamaDiskCache")

Entries = dict[tuple, Optional[int]]
"""A cache's keys → the size of the stored state, where the cache kind tells it."""


class StoredOrigins:
    """Per cache object: stored key hash → origin of the request that stored it."""

    def __init__(self) -> None:
        self._by_cache: "weakref.WeakKeyDictionary[Any, dict[str, StateOrigin]]" = weakref.WeakKeyDictionary()

    def of(self, cache: Any) -> dict[str, StateOrigin]:
        try:
            table = self._by_cache.get(cache)
            if table is None:
                table = {}
                self._by_cache[cache] = table
            return table
        except TypeError:  # not weak-referenceable: no provenance for it
            return {}


class _CacheThread(threading.local):
    """Per thread: how deep in instrumented cache calls (subclass → ``super()``), and the chosen key."""

    def __init__(self) -> None:
        self.depth = 0
        self.selected: Optional[Sequence[int]] = None
        """The key ``_find_longest_prefix_key`` chose in the current lookup."""


class SavedStates:
    """Stored ``LlamaState`` objects by their KV data: the tokens that data holds and who stored it.

    Keyed by the KV bytes, not by the state object: a cache that hands out a copy of another prompt's
    state under this prompt's ``input_ids`` still carries the other prompt's KV data, and is known by it.
    An entry lives as long as the stored object (its weak reference's callback removes it), so an id
    never names another object's bytes.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the callback may run during a collection inside the lock
        self._by_kv: dict[int, tuple[weakref.ref, StateOrigin]] = {}

    def remember(self, llama_state: Any, origin: StateOrigin) -> None:
        kv = getattr(llama_state, "llama_state", None)
        if not kv:  # no KV data (an empty bytes object is shared by every empty one): nothing to know it by
            return
        key = id(kv)
        with self._lock:
            self._by_kv[key] = (weakref.ref(llama_state, lambda ref, key=key: self._drop(key, ref)), origin)

    def _drop(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._by_kv.get(key)
            if entry is not None and entry[0] is ref:
                del self._by_kv[key]

    def stored(self, llama_state: Any) -> tuple[Any, Optional[StateOrigin]]:
        """The stored object whose KV data ``llama_state`` carries and its origin; ``(llama_state, None)``
        where kvtrace did not see it stored (a disk cache's unpickled copy, a cache filled before patching)."""
        kv = getattr(llama_state, "llama_state", None)
        with self._lock:
            entry = self._by_kv.get(id(kv))
        if entry is not None:
            stored = entry[0]()
            if stored is not None and getattr(stored, "llama_state", None) is kv:
                return stored, entry[1]
        return llama_state, None


ORIGINS = StoredOrigins()
SAVED = SavedStates()
_THREAD = _CacheThread()


def entries(cache: Any) -> Optional[Entries]:
    """Current keys (→ state size when known) of the built-in caches; ``None`` for unknown kinds."""
    ram = getattr(cache, "cache_state", None)
    if isinstance(ram, dict):
        return {k: getattr(v, "llama_state_size", None) for k, v in ram.items()}
    disk = getattr(cache, "cache", None)
    if disk is not None and hasattr(disk, "iterkeys"):
        return {k: None for k in disk.iterkeys()}
    return None


@contextlib.contextmanager
def _outer_call(cache: Any, what: str) -> Iterator[tuple[Optional[CallState], Optional[Entries]]]:
    """The request a cache call belongs to and the cache's keys before it (to see what the call
    added, popped or evicted); no request when the call is nested (subclass → ``super()``) or
    nothing is being recorded."""
    nested = _THREAD.depth > 0
    _THREAD.depth += 1
    try:
        state = None if nested else CALLS.current()
        before = None
        if state is not None:
            try:
                before = entries(cache)
            except Exception:
                FAILURES.count(f"cache {what} (entries)", state.recorder)
        yield state, before
    finally:
        _THREAD.depth -= 1


def find_wrapper(wrapped, instance, args, kwargs):
    """``_find_longest_prefix_key``: remember which key the lookup chose."""
    result = wrapped(*args, **kwargs)
    _THREAD.selected = result
    return result


def lookup_wrapper(wrapped, instance, args, kwargs):
    """``__getitem__``: a lookup, missed (``KeyError``) or found (a hit once the state is restored)."""
    with _outer_call(instance, "lookup") as (state, before):
        if state is None:
            return wrapped(*args, **kwargs)
        _THREAD.selected = None
        try:
            value = wrapped(*args, **kwargs)
        except KeyError:
            record_lookup(state, instance, args, before, None, None)
            raise
        record_lookup(state, instance, args, before, _THREAD.selected, value)
        return value


def record_lookup(state: CallState, cache: Any, args: tuple, before: Optional[Entries],
                  selected: Optional[Sequence[int]], value: Any) -> None:
    try:
        recorder, record = state.recorder, state.record
        key = list(args[0]) if args else []
        scanned = len(before) if before is not None else None
        if value is None:
            record.events.append(CacheEvent(sc.EVENT_CACHE_LOOKUP, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_MISS,
                                            tokens=len(key), prefix_tokens=0, entries_scanned=scanned))
            return
        if selected is None:  # a cache kind that selects without _find_longest_prefix_key
            selected = value.input_ids[: value.n_tokens].tolist()
        key_hash = recorder.hash_tokens(selected)
        origins = ORIGINS.of(cache)
        origin = origins.get(key_hash)
        event = CacheEvent(sc.EVENT_CACHE_LOOKUP, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_SKIPPED, key_hash=key_hash,
                           tokens=len(selected), prefix_tokens=common_prefix(selected, key),
                           entries_scanned=scanned, source=origin)
        record.events.append(event)
        state.pending_lookup = event
        after = entries(cache) if before is not None else None
        if after is not None and tuple(selected) in before and tuple(selected) not in after:
            # LlamaDiskCache pops the entry it returns: the state leaves the cache.
            record.events.append(CacheEvent(sc.EVENT_CACHE_EVICT, sc.LAYER_PROMPT_CACHE, key_hash=key_hash,
                                            tokens=len(selected), reason=sc.REASON_TAKEN_ON_LOOKUP, source=origin))
            origins.pop(key_hash, None)
    except Exception:
        FAILURES.count("cache lookup", state.recorder)


def store_wrapper(wrapped, instance, args, kwargs):
    """``__setitem__``: a store, and the entries it evicted to make room."""
    with _outer_call(instance, "store") as (state, before):
        if state is None:
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        record_store(state, instance, args, before)
        return result


def record_store(state: CallState, cache: Any, args: tuple, before: Optional[Entries]) -> None:
    try:
        recorder, record = state.recorder, state.record
        key = tuple(args[0])
        value = args[1]
        key_hash = recorder.hash_tokens(key)
        origins = ORIGINS.of(cache)
        now = time.time_ns()
        after = entries(cache) if before is not None else None
        stored = after is None or key in after
        if stored:
            origin = record.origin()
            origins[key_hash] = origin
            SAVED.remember(value, origin)
        record.events.append(CacheEvent(sc.EVENT_CACHE_STORE, sc.LAYER_PROMPT_CACHE, time_unix_nano=now,
                                        outcome=sc.OUTCOME_STORED if stored else sc.OUTCOME_EVICTED_IMMEDIATELY,
                                        key_hash=key_hash, tokens=len(key),
                                        size_bytes=getattr(value, "llama_state_size", None)))
        if after is None:
            return
        for old_key, size in before.items():
            if old_key in after or old_key == key:
                continue
            old_hash = recorder.hash_tokens(old_key)
            record.events.append(CacheEvent(sc.EVENT_CACHE_EVICT, sc.LAYER_PROMPT_CACHE, time_unix_nano=now,
                                            key_hash=old_hash, tokens=len(old_key), size_bytes=size,
                                            reason=sc.REASON_CAPACITY, source=origins.pop(old_hash, None)))
    except Exception:
        FAILURES.count("cache store", state.recorder)


def load_state_wrapper(wrapped, instance, args, kwargs):
    """``Llama.load_state`` after a lookup: the lookup was a hit, and the request runs on that state."""
    state = CALLS.of(instance)
    if state is not None and state.pending_lookup is not None:
        try:
            lookup = state.pending_lookup
            state.pending_lookup = None
            lookup.outcome = sc.OUTCOME_HIT
            llama_state = args[0] if args else kwargs["state"]
            record = state.record
            record.state_key = lookup.key_hash
            record.state_origin = lookup.source
            state.restored = True
            record.events.append(CacheEvent(sc.EVENT_CACHE_RESTORE, sc.LAYER_PROMPT_CACHE,
                                            key_hash=lookup.key_hash, tokens=int(llama_state.n_tokens),
                                            size_bytes=getattr(llama_state, "llama_state_size", None),
                                            source=lookup.source))
            stored, stored_by = SAVED.stored(llama_state)
            if stored is not llama_state:  # a copy carrying another state's KV data: compare what that holds
                state.restored_tokens = stored.input_ids[: int(stored.n_tokens)]
                state.restored_origin = stored_by
        except Exception:
            FAILURES.count("load_state", state.recorder)
    return wrapped(*args, **kwargs)


CACHE_METHODS = {"__getitem__": lookup_wrapper, "__setitem__": store_wrapper, "_find_longest_prefix_key": find_wrapper}
"""Cache method → its wrapper, for the built-in caches and users' subclasses alike."""


class CacheClasses:
    """Users' ``BaseLlamaCache`` subclasses, wrapped on the class that defines each cache method.

    Covers the subclasses that exist at ``patch()`` and any other a request meets later; the
    built-in caches are the hook table's (their methods are found already wrapped here).
    """

    def __init__(self) -> None:
        self.active = False
        self._covered: set[type] = set()
        self._wrappings = Wrappings()

    def install(self) -> None:
        self.active = True
        module = sys.modules.get(CACHE_MODULE)
        base = getattr(module, "BaseLlamaCache", None)
        if base is not None:
            for cls in _all_subclasses(base):
                self.cover(cls)

    def restore(self) -> None:
        self.active = False
        self._wrappings.restore_all()
        self._covered.clear()

    def cover(self, cls: type) -> None:
        if cls in self._covered or not self.active:
            return
        self._covered.add(cls)
        for name, wrapper in CACHE_METHODS.items():
            owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
            if owner is None or owner is object:
                continue
            attr = owner.__dict__[name]
            if is_wrapped(attr) or getattr(attr, "__isabstractmethod__", False):
                continue
            self._wrappings.wrap(owner, name, wrapper)


CACHE_CLASSES = CacheClasses()


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out
