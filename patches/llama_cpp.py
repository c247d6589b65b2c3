"""llama-cpp-python instrumentation (imported as ``kvtrace.patches.llama_cpp``).

One :class:`~kvtrace.recording.records.RequestRecord` per generation call
(``Llama.create_completion`` / ``create_chat_completion``, streaming or not),
filled from these hook points (see the engine notes in the project docs):

* ``Llama.generate`` — called once per request, before its body runs: the
  longest common prefix of the live context and the prompt, and the sampling
  parameters actually handed to the sampler;
* ``Llama.eval`` — the first evaluation of a request says what llama.cpp did:
  ``self.n_tokens`` tokens were kept from the live KV cache, ``len(tokens)``
  are recomputed (one of them replayed when the whole prompt matched);
* ``Llama.sample`` — reads the current step's raw logits row through a
  read-only zero-copy view and records chosen id, top-1, runner-up, margin and
  the chosen token's log-probability;
* ``Llama.load_state`` — a prompt-cache restore: marks the pending lookup a
  hit and records the provenance of the restored state;
* ``BaseLlamaCache`` subclasses, patched on the class (dunder methods are
  looked up on the type): lookups, stores and evictions;
* ``llama_cpp.server.app.create_app`` — adds an ASGI middleware that makes the
  W3C ``traceparent``/``baggage`` of each HTTP request the current context.

Invariants: the engine's return values and buffers are never modified (the
logits view is read-only); every hook catches its own failures, counts them
in ``recorder.pipeline.counters["instrumentation_errors"]`` and returns the
engine's result unchanged.  The request being recorded is bound to the
executing thread through a context variable only while the engine works on
it (during the call, and during each step of a stream).
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import hashlib
import inspect
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from kvtrace import semconv as sc
from kvtrace.patches.hooks import HookFailures, Wrappings, add_trace_context_middleware, version_supported
from kvtrace.patches.llama_cpp_repack import cpu_has_amx, loaded_with_repack
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin
from kvtrace.recording.recorder import Recorder, get_recorder

log = logging.getLogger("kvtrace")

ENGINE = "llama_cpp"
MODULE = "llama_cpp"
DISTRIBUTION = "llama-cpp-python"
SUPPORTED = ">=0.3.30,<0.4"

_patched = False
_wrappings = Wrappings()
_patched_cache_classes: set[type] = set()
_failures = HookFailures(ENGINE)


# --- versions ----------------------------------------------------------------------------


def get_version() -> str:
    """Installed llama-cpp-python version ("" when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        try:
            import llama_cpp

            return str(getattr(llama_cpp, "__version__", ""))
        except ImportError:
            return ""


def supported_versions() -> dict[str, str]:
    """Distribution name → version specifier this patch is written against."""
    return {DISTRIBUTION: SUPPORTED}


def is_supported(version: str) -> bool:
    return version_supported(version, SUPPORTED)


# --- per-request state ---------------------------------------------------------------------


@dataclass
class _CallState:
    """What kvtrace tracks while one generation call runs on one ``Llama``."""

    recorder: Recorder
    record: RequestRecord
    llama: Any
    prompt: Optional[list[int]] = None
    live_tokens_before: int = 0
    """``n_tokens`` when ``generate`` was called: the live context llama.cpp could reuse."""
    live_prefix: int = 0
    """Longest common prefix of the live context and the prompt."""
    prompt_evaluated: bool = False
    pending_lookup: Optional[CacheEvent] = None
    restored: bool = False
    finished: bool = False


_CURRENT: contextvars.ContextVar[Optional[_CallState]] = contextvars.ContextVar("kvtrace_llama_call", default=None)
_cache_guard = threading.local()  # reentrancy guard for cache subclasses calling super()


def _state_for(llama: Any) -> Optional[_CallState]:
    state = _CURRENT.get()
    if state is None or state.llama is not llama or state.finished:
        return None
    return state


def _count_error(where: str, recorder: Optional[Recorder] = None) -> None:
    """Count (and log once per hook) an instrumentation failure; never raises."""
    _failures.count(where, recorder)


# --- generation calls ----------------------------------------------------------------------


def _begin(llama: Any, operation: str, kwargs: dict) -> Optional[_CallState]:
    """Start a record unless this call is nested in one already being recorded."""
    if _state_for(llama) is not None:
        return None  # create_chat_completion → create_completion: one request, one record
    recorder = None
    try:
        recorder = get_recorder()  # may raise on a malformed KVTRACE_* setting: never the host's problem
        if recorder is None:
            return None
        record = recorder.start_request(ENGINE, operation=operation, model=_model_name(llama, kwargs))
        state = _CallState(recorder=recorder, record=record, llama=llama)
        record.config.update(_static_config(llama))
        record.config[sc.CACHE_SETTINGS] = _cache_settings(llama)
        if kwargs.get("max_tokens") is not None:
            record.config[sc.GEN_AI_REQUEST_MAX_TOKENS] = int(kwargs["max_tokens"])
        cache = getattr(llama, "cache", None)
        if cache is not None:
            _patch_cache_class(type(cache))
        return state
    except Exception:
        _count_error("request start", recorder)
        return None


def _end(state: _CallState, result: Any = None, error: Optional[BaseException] = None,
         finish_reason: Optional[str] = None) -> None:
    if state.finished:
        return
    state.finished = True
    record = state.record
    try:
        if error is not None:
            record.error = f"{type(error).__name__}: {error}"
        reason = finish_reason or _finish_reason(result)
        if reason:
            record.finish_reason = reason
    except Exception:
        _count_error("request end", state.recorder)
    state.recorder.finish(record)


def _completion_wrapper(operation: str) -> Callable:
    def wrapper(wrapped, instance, args, kwargs):
        state = _begin(instance, operation, kwargs)
        if state is None:
            return wrapped(*args, **kwargs)
        token = _CURRENT.set(state)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            _end(state, error=exc)
            raise
        finally:
            _CURRENT.reset(token)
        if isinstance(result, Iterator):  # stream=True: the engine works while the caller iterates
            return _traced_stream(state, result)
        _end(state, result=result)
        return result

    return wrapper


def _traced_stream(state: _CallState, chunks: Iterator) -> Iterator:
    """Yield the engine's chunks unchanged, binding the request while each one is produced.

    The record is finished when the stream ends, fails, or is closed early
    (``finish_reason`` ``cancelled`` unless the engine gave one).
    """
    last_reason: Optional[str] = None
    try:
        while True:
            token = _CURRENT.set(state)
            try:
                chunk = next(chunks)
            except StopIteration:
                break
            finally:
                _CURRENT.reset(token)
            try:
                last_reason = _finish_reason(chunk) or last_reason
            except Exception:
                pass
            yield chunk
    except GeneratorExit:
        _close_quietly(chunks, state)
        _end(state, finish_reason=last_reason or sc.FINISH_CANCELLED)
        raise
    except BaseException as exc:
        _end(state, error=exc, finish_reason=last_reason)
        raise
    _end(state, finish_reason=last_reason)


def _close_quietly(chunks: Iterator, state: _CallState) -> None:
    token = _CURRENT.set(state)
    try:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    except Exception:
        pass
    finally:
        _CURRENT.reset(token)


def _finish_reason(result: Any) -> Optional[str]:
    if isinstance(result, dict):
        choices = result.get("choices") or []
        if choices and isinstance(choices[0], dict):
            return choices[0].get("finish_reason")
    return None


# --- generate / eval: in-context prefix reuse -----------------------------------------------


_GENERATE_SIGNATURE: Optional[inspect.Signature] = None


def _generate_wrapper(wrapped, instance, args, kwargs):
    state = _state_for(instance)
    if state is not None and state.prompt is None:
        try:
            _on_generate(state, instance, args, kwargs)
        except Exception:
            _count_error("generate", state.recorder)
    return wrapped(*args, **kwargs)


def _on_generate(state: _CallState, llama: Any, args: tuple, kwargs: dict) -> None:
    global _GENERATE_SIGNATURE
    if _GENERATE_SIGNATURE is None:
        generate = type(llama).generate
        _GENERATE_SIGNATURE = inspect.signature(getattr(generate, "__wrapped__", generate))
    bound = _GENERATE_SIGNATURE.bind_partial(llama, *args, **kwargs)
    params = {k: v for k, v in bound.arguments.items() if k != "self"}
    defaults = {k: p.default for k, p in _GENERATE_SIGNATURE.parameters.items() if p.default is not p.empty}
    prompt = [int(t) for t in params["tokens"]]
    state.prompt = prompt
    n_live = int(llama.n_tokens)
    state.live_tokens_before = n_live
    reset = params.get("reset", defaults.get("reset", True))
    state.live_prefix = _common_prefix(llama.input_ids[:n_live], prompt) if (reset and n_live > 0) else 0

    record = state.record
    record.prompt_token_ids = prompt
    record.prompt_tokens = len(prompt)

    def param(name: str) -> Any:
        return params.get(name, defaults.get(name))

    sampling = {name: param(name) for name in (
        "temp", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
        "presence_penalty", "tfs_z", "mirostat_mode", "mirostat_tau", "mirostat_eta")}
    seed = int(getattr(llama, "_seed", 0) or 0)
    sampling["seed"] = seed
    sampling["penalty_last_n"] = getattr(llama, "last_n_tokens_size", None)
    sampling["grammar"] = params.get("grammar") is not None
    sampling["logits_processor"] = params.get("logits_processor") is not None
    record.config[sc.SAMPLING_SETTINGS] = sampling
    record.config[sc.GEN_AI_REQUEST_TEMPERATURE] = float(sampling["temp"])
    record.config[sc.GEN_AI_REQUEST_TOP_P] = float(sampling["top_p"])
    record.config[sc.GEN_AI_REQUEST_TOP_K] = int(sampling["top_k"])
    record.config[sc.GEN_AI_REQUEST_SEED] = seed


def _eval_wrapper(wrapped, instance, args, kwargs):
    state = _state_for(instance)
    if state is not None and not state.prompt_evaluated and state.prompt is not None:
        try:
            tokens = args[0] if args else kwargs["tokens"]
            _on_prompt_eval(state, int(instance.n_tokens), len(tokens))
        except Exception:
            _count_error("eval", state.recorder)
    return wrapped(*args, **kwargs)


def _on_prompt_eval(state: _CallState, kept: int, evaluated: int) -> None:
    """The first ``eval`` of a request: ``kept`` tokens stay in the KV cache, ``evaluated`` are computed."""
    state.prompt_evaluated = True
    record = state.record
    prompt_len = len(state.prompt or ())
    record.reused_tokens = kept
    record.recomputed_tokens = evaluated
    # The whole prompt matched the live context, yet llama.cpp re-evaluates
    # its last token to refresh the logits: cached, but recomputed.
    replayed = kept > 0 and state.live_prefix >= prompt_len and evaluated == 1 and kept == prompt_len - 1
    record.replayed_tokens = 1 if replayed else 0
    layer = sc.LAYER_NONE
    if kept > 0:
        layer = sc.LAYER_PROMPT_CACHE if state.restored else sc.LAYER_KV_REUSE
    record.cache_layer = layer
    block = state.recorder.settings.block_size
    record.block_layers = [layer if (i + 1) * block <= kept else sc.LAYER_NONE for i in range(prompt_len // block)]
    if state.live_tokens_before > 0 or kept > 0:
        record.events.append(CacheEvent(
            name=sc.EVENT_CACHE_REUSE,
            layer=layer if kept > 0 else sc.LAYER_KV_REUSE,
            outcome=sc.OUTCOME_HIT if kept > 0 else sc.OUTCOME_MISS,
            key_hash=record.state_key if state.restored else None,
            tokens=kept,
            prefix_tokens=state.live_prefix,
            reason=sc.REASON_REPLAY_LAST_TOKEN if replayed else None,
            source=record.state_origin if state.restored else None,
        ))


def _common_prefix(live: Sequence[int], prompt: Sequence[int]) -> int:
    """Length of the longest common prefix (vectorised; llama.cpp compares the same way)."""
    n = min(len(live), len(prompt))
    if n == 0:
        return 0
    a = np.asarray(live[:n], dtype=np.int64)
    b = np.asarray(prompt[:n], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n


# --- sample: per-token margins -------------------------------------------------------------


_SAMPLE_IDX_POSITION = 15  # Llama.sample(top_k, ..., grammar, idx)


def _sample_wrapper(wrapped, instance, args, kwargs):
    state = _state_for(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    decision = None
    try:
        idx = kwargs.get("idx", args[_SAMPLE_IDX_POSITION] if len(args) > _SAMPLE_IDX_POSITION else None)
        decision = _raw_top2(instance, idx)
    except Exception:
        _count_error("sample (logits)", state.recorder)
    token = wrapped(*args, **kwargs)
    if decision is not None:
        try:
            top1, runner_up, margin, row = decision
            state.record.add_token(int(token), top1, runner_up, margin, _logprob(row, int(token), top1))
        except Exception:
            _count_error("sample (record)", state.recorder)
    return token


def _logits_row(llama: Any, idx: Optional[int]) -> np.ndarray:
    """The current step's raw logits as a read-only zero-copy view (valid until the next decode)."""
    ridx = idx - llama.n_tokens if idx is not None else -1
    pointer = llama._ctx.get_logits_ith(ridx)
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    if not address:
        raise ValueError(f"llama.cpp has no logits for output row {ridx}")
    # A view, not a copy (cheaper than np.ctypeslib.as_array); locked read-only so kvtrace cannot write logits.
    row = np.frombuffer(_float_array(int(llama._n_vocab)).from_address(address), dtype=np.float32)
    row.flags.writeable = False
    return row


@functools.lru_cache(maxsize=8)
def _float_array(n: int) -> type:
    return ctypes.c_float * n


def _raw_top2(llama: Any, idx: Optional[int]) -> tuple[int, int, float, np.ndarray]:
    """(top-1 id, runner-up id, top-1 − top-2 margin, row) of the raw logits.

    Two vectorised passes and no copy: ``argmax`` of the row, then ``argmax``
    of the slices either side of it.  Ties go to the lower token id (as
    ``argmax`` does), so equal logits give a margin of exactly 0.
    """
    row = _logits_row(llama, idx)
    top1 = int(row.argmax())
    runner_up, runner_value = -1, -np.inf
    if top1 > 0:
        runner_up = int(row[:top1].argmax())
        runner_value = float(row[runner_up])
    if top1 + 1 < row.shape[0]:
        right = top1 + 1 + int(row[top1 + 1:].argmax())
        if float(row[right]) > runner_value:
            runner_up, runner_value = right, float(row[right])
    return top1, runner_up, float(row[top1]) - runner_value, row


def _logprob(row: np.ndarray, token: int, top1: int) -> float:
    """log-softmax of the raw logits at ``token`` (max-shifted for stability)."""
    peak = row[top1]
    total = np.exp(row - peak).sum(dtype=np.float64)  # float32 exp (SIMD), float64 accumulation
    return float(row[token] - peak - np.log(total))


# --- prompt cache --------------------------------------------------------------------------


# Per cache object: stored key hash → origin of the request that stored it.
_origins: "weakref.WeakKeyDictionary[Any, dict[str, StateOrigin]]" = weakref.WeakKeyDictionary()
_selection = threading.local()  # the key _find_longest_prefix_key chose in this thread


def _origins_of(cache: Any) -> dict[str, StateOrigin]:
    try:
        table = _origins.get(cache)
        if table is None:
            table = {}
            _origins[cache] = table
        return table
    except TypeError:  # not weak-referenceable: no provenance for it
        return {}


def _entries(cache: Any) -> Optional[dict[tuple, Optional[int]]]:
    """Current keys (→ state size when known) of the built-in caches; ``None`` for unknown kinds."""
    ram = getattr(cache, "cache_state", None)
    if isinstance(ram, dict):
        return {k: getattr(v, "llama_state_size", None) for k, v in ram.items()}
    disk = getattr(cache, "cache", None)
    if disk is not None and hasattr(disk, "iterkeys"):
        return {k: None for k in disk.iterkeys()}
    return None


class _Reentry:
    """True inside an already-instrumented cache call in this thread (subclass → super())."""

    def __enter__(self) -> bool:
        depth = getattr(_cache_guard, "depth", 0)
        _cache_guard.depth = depth + 1
        return depth > 0

    def __exit__(self, *exc) -> None:
        _cache_guard.depth -= 1


def _cache_find_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    _selection.key = result
    return result


def _outer_cache_call(nested: bool) -> Optional[_CallState]:
    """The request a cache call belongs to, unless it is nested (subclass → super()) or unrecorded."""
    state = _CURRENT.get()
    return None if nested or state is None or state.finished else state


def _entries_before(cache: Any, state: _CallState, what: str) -> Optional[dict[tuple, Optional[int]]]:
    """The cache's keys before the engine's call (to see what it added, popped or evicted)."""
    try:
        return _entries(cache)
    except Exception:
        _count_error(f"cache {what} (entries)", state.recorder)
        return None


def _cache_getitem_wrapper(wrapped, instance, args, kwargs):
    with _Reentry() as nested:
        state = _outer_cache_call(nested)
        if state is None:
            return wrapped(*args, **kwargs)
        before = _entries_before(instance, state, "lookup")
        _selection.key = None
        try:
            value = wrapped(*args, **kwargs)
        except KeyError:
            _record_lookup(state, instance, args, before, None, None)
            raise
        _record_lookup(state, instance, args, before, _selection.key, value)
        return value


def _record_lookup(state: _CallState, cache: Any, args: tuple, before: Optional[dict],
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
        origins = _origins_of(cache)
        origin = origins.get(key_hash)
        event = CacheEvent(sc.EVENT_CACHE_LOOKUP, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_SKIPPED, key_hash=key_hash,
                           tokens=len(selected), prefix_tokens=_common_prefix(selected, key),
                           entries_scanned=scanned, source=origin)
        record.events.append(event)
        state.pending_lookup = event
        after = _entries(cache) if before is not None else None
        if after is not None and tuple(selected) in before and tuple(selected) not in after:
            # LlamaDiskCache pops the entry it returns: the state leaves the cache.
            record.events.append(CacheEvent(sc.EVENT_CACHE_EVICT, sc.LAYER_PROMPT_CACHE, key_hash=key_hash,
                                            tokens=len(selected), reason=sc.REASON_TAKEN_ON_LOOKUP, source=origin))
            origins.pop(key_hash, None)
    except Exception:
        _count_error("cache lookup", state.recorder)


def _cache_setitem_wrapper(wrapped, instance, args, kwargs):
    with _Reentry() as nested:
        state = _outer_cache_call(nested)
        if state is None:
            return wrapped(*args, **kwargs)
        before = _entries_before(instance, state, "store")
        result = wrapped(*args, **kwargs)
        _record_store(state, instance, args, before)
        return result


def _record_store(state: _CallState, cache: Any, args: tuple, before: Optional[dict]) -> None:
    try:
        recorder, record = state.recorder, state.record
        key = tuple(args[0])
        value = args[1]
        key_hash = recorder.hash_tokens(key)
        origins = _origins_of(cache)
        now = time.time_ns()
        after = _entries(cache) if before is not None else None
        stored = after is None or key in after
        if stored:
            origins[key_hash] = record.origin()
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
        _count_error("cache store", state.recorder)


def _load_state_wrapper(wrapped, instance, args, kwargs):
    state = _state_for(instance)
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
        except Exception:
            _count_error("load_state", state.recorder)
    return wrapped(*args, **kwargs)


def _patch_cache_class(cls: type) -> None:
    """Wrap lookup/store of a ``BaseLlamaCache`` subclass on the class that defines them."""
    if cls in _patched_cache_classes or not _patched:
        return
    import wrapt

    _patched_cache_classes.add(cls)
    for name, wrapper in (("__getitem__", _cache_getitem_wrapper), ("__setitem__", _cache_setitem_wrapper),
                          ("_find_longest_prefix_key", _cache_find_wrapper)):
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or owner is object:
            continue
        attr = owner.__dict__[name]
        if isinstance(attr, wrapt.ObjectProxy) or getattr(attr, "__isabstractmethod__", False):
            continue
        _wrappings.wrap(owner, name, wrapper)


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


# --- configuration -------------------------------------------------------------------------


def _model_name(llama: Any, kwargs: dict) -> str:
    name = kwargs.get("model")
    if name:
        return str(name)
    return os.path.basename(str(getattr(llama, "model_path", "") or ""))


def _static_config(llama: Any) -> dict[str, Any]:
    """Per-``Llama`` configuration (computed once, cached on the instance)."""
    cached = getattr(llama, "_kvtrace_static_config", None)
    if cached is None:
        cached = _compute_static_config(llama)
        try:
            llama._kvtrace_static_config = cached
        except Exception:
            pass
    return dict(cached)


def _compute_static_config(llama: Any) -> dict[str, Any]:
    metadata = dict(getattr(llama, "metadata", {}) or {})
    params = llama.context_params
    type_k, type_v = _ggml_type_name(params.type_k), _ggml_type_name(params.type_v)
    numerics = {
        "n_ctx": int(llama.n_ctx()),
        "n_batch": int(llama.n_batch),
        "n_ubatch": int(params.n_ubatch),
        "n_threads": int(params.n_threads),
        "n_threads_batch": int(params.n_threads_batch),
        "flash_attn": _flash_attn(params.flash_attn_type),
        "type_k": type_k,
        "type_v": type_v,
        "logits_all": bool(getattr(llama, "_logits_all", False)),
        "offload_kqv": bool(params.offload_kqv),
        "n_gpu_layers": int(llama.model_params.n_gpu_layers),
        # Repacked weights (AMX and other extra buffer types) run other kernels, hence other numerics.
        "weight_repack": loaded_with_repack(llama),
        "cpu_amx": cpu_has_amx(),
    }
    config: dict[str, Any] = {
        sc.ENGINE_VERSION: get_version(),
        sc.MODEL_FINGERPRINT: _fingerprint(str(getattr(llama, "model_path", "")), metadata),
        sc.MODEL_WEIGHT_FORMAT: _weight_format(metadata),
        sc.KV_CACHE_TYPE: type_k if type_k == type_v else f"{type_k}/{type_v}",
        sc.NUMERICS_SETTINGS: numerics,
    }
    system_info = _system_info()
    if system_info:
        numerics["system_info"] = system_info  # CPU features pick the kernels, hence the numerics
    return config


def _cache_settings(llama: Any) -> dict[str, Any]:
    cache = getattr(llama, "cache", None)
    settings: dict[str, Any] = {"kv_reuse": True, "prompt_cache": None}
    if cache is not None:
        settings["prompt_cache"] = type(cache).__name__
        settings["capacity_bytes"] = getattr(cache, "capacity_bytes", None)
    return settings


def _fingerprint(path: str, metadata: dict[str, str]) -> str:
    """Cheap identity of the weights: GGUF metadata, file size and the file's last 64 KiB.

    The tail lies inside the tensor data, so two random-weight files with
    identical metadata still differ; nothing near the file's full size is read.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    try:
        size = os.path.getsize(path)
        digest.update(str(size).encode())
        with open(path, "rb") as f:
            f.seek(max(0, size - 65536))
            digest.update(f.read(65536))
    except OSError:
        pass
    return digest.hexdigest()


def _weight_format(metadata: dict[str, str]) -> str:
    raw = metadata.get("general.file_type")
    if raw is None:
        return "unknown"
    try:
        from gguf import LlamaFileType

        name = LlamaFileType(int(raw)).name
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except Exception:
        return f"file_type_{raw}"


def _ggml_type_name(value: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(value)).name.lower()
    except Exception:
        return str(value)


def _flash_attn(value: int) -> str:
    return {-1: "auto", 0: "disabled", 1: "enabled"}.get(int(value), str(value))


def _system_info() -> str:
    """llama.cpp's report of the CPU features and backends it was built with."""
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info()
        text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
        return text.strip()[:200]
    except Exception:
        return ""


# --- server: W3C trace context per HTTP request --------------------------------------------


def _create_app_wrapper(wrapped, instance, args, kwargs):
    app = wrapped(*args, **kwargs)
    if _patched:
        try:
            add_trace_context_middleware(app, _failures)
        except Exception:
            _count_error("server create_app")
    return app


def _on_server_app_import(module: Any) -> None:
    if not _patched or (module, "create_app") in _wrappings:
        return
    try:
        _wrappings.wrap(module, "create_app", _create_app_wrapper)
    except Exception:
        _count_error("server patch")


# --- patch / unpatch -----------------------------------------------------------------------


def patch() -> bool:
    """Instrument llama-cpp-python.  Idempotent; returns whether it is instrumented.

    An unsupported version is refused with a logged message; nothing raises.
    """
    global _patched
    if _patched:
        return True
    version = get_version()
    if not version or not is_supported(version):
        log.warning("kvtrace: llama-cpp-python %s is not supported (kvtrace supports %s %s); "
                    "requests are not traced", version or "(not installed)", DISTRIBUTION, SUPPORTED)
        return False
    import wrapt
    import llama_cpp.llama
    import llama_cpp.llama_cache as llama_cache

    Llama = llama_cpp.llama.Llama
    _patched = True
    for name, wrapper in (
        ("create_completion", _completion_wrapper(sc.OPERATION_TEXT_COMPLETION)),
        ("create_chat_completion", _completion_wrapper(sc.OPERATION_CHAT)),
        ("generate", _generate_wrapper),
        ("eval", _eval_wrapper),
        ("sample", _sample_wrapper),
        ("load_state", _load_state_wrapper),
    ):
        _wrappings.wrap(Llama, name, wrapper)
    for cls in [llama_cache.LlamaRAMCache, llama_cache.LlamaDiskCache, *_all_subclasses(llama_cache.BaseLlamaCache)]:
        _patch_cache_class(cls)
    wrapt.when_imported("llama_cpp.server.app")(_on_server_app_import)
    return True


def unpatch() -> None:
    """Restore every wrapped attribute.  Idempotent."""
    global _patched
    _patched = False
    _wrappings.restore_all()
    _patched_cache_classes.clear()
