"""The engine core owns the record: a request is admitted, and later freed, here.

* ``KVCacheManager.get_computed_blocks`` — the prefix-cache lookup (may run more than once for a
  waiting request; the last one before admission counts);
* ``KVCacheManager.record_prefix_cache_stats`` — once per admission: the record starts here, with
  hit tokens, hit block ids and vLLM's block hashes, inside the trace context and baggage the API
  process put in the request's ``trace_headers``; the hit blocks' own hashes are checked against the
  prompt's block-hash chain (the cache integrity verdict).  A request admitted again after a preemption
  keeps its record; the new lookup is noted on it;
* ``Scheduler._free_request`` — the request finished: :mod:`.request_end` turns its sampled rows into
  the output tokens' margins, their steps' shapes into its batch composition, and the record into the
  ``kvtrace.request`` span, without waiting for the device.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Optional

from opentelemetry import context

from kvtrace import semconv as sc
from kvtrace.patches.hooks import observing
from kvtrace.patches.vllm.api_process import BAGGAGE_HEADER, PROPAGATOR, REQUEST_ID_HEADER, TRACE_CONTEXT
from kvtrace.patches.vllm.block_pool import PROVENANCE
from kvtrace.patches.vllm.common import ENGINE, FAILURES, arg, bare_hashes, hash_hex, hash_hexes
from kvtrace.patches.vllm.config import SETTINGS, sampling_attributes
from kvtrace.patches.vllm import request_end
from kvtrace.patches.vllm.live_requests import LIVE, LiveRequest
from kvtrace.recording.records import CacheEvent, RequestRecord
from kvtrace.recording.recorder import Recorder, get_recorder


def _on_lookup(result: Any, manager: Any, args: tuple, kwargs: dict) -> None:
    """``get_computed_blocks(request)`` returned ``(KVCacheBlocks, hit tokens, ...)``: vLLM 0.32 and
    0.33 differ in what follows the first two."""
    if isinstance(result, tuple) and len(result) >= 2:
        LIVE.note_lookup(str(arg(args, kwargs, 0, "request").request_id), result[0])


get_computed_blocks = observing(FAILURES, "get_computed_blocks", _on_lookup)


def _on_admission(result: Any, manager: Any, args: tuple, kwargs: dict) -> None:
    """``record_prefix_cache_stats(request, num_hits)``."""
    request = arg(args, kwargs, 0, "request")
    num_hits = int(arg(args, kwargs, 1, "num_hits") or 0)
    internal_id = str(request.request_id)
    blocks = LIVE.take_lookup(internal_id)
    block_size = SETTINGS.block_size or int(getattr(manager, "block_size", 0) or 0) or 1
    prompt = list(getattr(request, "prompt_token_ids", None) or [])
    prompt_blocks = len(prompt) // block_size
    own = list(itertools.islice(getattr(request, "block_hashes", ()), prompt_blocks))
    vendor = hash_hexes(own)
    hit_blocks = min(num_hits // block_size, len(vendor))
    hit_hashes = vendor[:hit_blocks]
    source = PROVENANCE.source_of(hit_hashes[-1]) if hit_hashes else None
    lookup = CacheEvent(
        name=sc.EVENT_CACHE_LOOKUP, layer=sc.LAYER_PREFIX_BLOCKS,
        outcome=sc.OUTCOME_HIT if num_hits else sc.OUTCOME_MISS,
        key_hash=hit_hashes[-1] if hit_hashes else None, tokens=len(prompt), prefix_tokens=num_hits,
        block_hashes=hit_hashes, block_ids=_hit_block_ids(blocks)[:hit_blocks], source=source,
    )
    live = LIVE.get(internal_id)
    if live is not None:  # re-admission after preemption: the request recomputes, note the lookup
        lookup.reason = sc.REASON_PREEMPTED
        live.record.events.append(lookup)
        return
    recorder = get_recorder()
    if recorder is None:
        return
    record = _correlated_start(recorder, request)
    record.model = record.model or SETTINGS.model
    record.config.update(SETTINGS.attributes)
    record.config.update(sampling_attributes(getattr(request, "sampling_params", None)))
    record.prompt_token_ids = prompt
    record.prompt_tokens = len(prompt)
    record.vendor_block_hashes = vendor
    record.reused_tokens = num_hits
    record.recomputed_tokens = len(prompt) - num_hits
    record.cache_layer = sc.LAYER_PREFIX_BLOCKS if num_hits else sc.LAYER_NONE
    record.hit_block_hashes = hit_hashes or None
    record.block_layers = [sc.LAYER_PREFIX_BLOCKS] * hit_blocks + [sc.LAYER_NONE] * (prompt_blocks - hit_blocks)
    record.state_key = hit_hashes[-1] if hit_hashes else None
    record.state_origin = source
    if num_hits:
        try:
            judge_hit(record, blocks, own, num_hits, hit_blocks, block_size)
        except Exception:  # the record goes on without a verdict
            FAILURES.count("integrity")
    early = LIVE.admit(internal_id, LiveRequest(recorder=recorder, record=record), lookup)
    PROVENANCE.remember(record, early)


record_prefix_cache_stats = observing(FAILURES, "admission", _on_admission)


def _correlated_start(recorder: Recorder, request: Any) -> RequestRecord:
    """Start the record inside the trace context and with the baggage the request came with."""
    headers = getattr(request, "trace_headers", None) or {}  # read only
    internal_id = str(request.request_id)
    external_id = headers.get(REQUEST_ID_HEADER) or _external_id(internal_id)
    entries = _carried_baggage(headers.get(BAGGAGE_HEADER))
    if entries is not None:
        extract = TRACE_CONTEXT.extract if "traceparent" in headers else None
    else:  # trace headers kvtrace did not write (vLLM's own): the W3C propagators read them
        extract = PROPAGATOR.extract if len(headers) > (REQUEST_ID_HEADER in headers) else None
    token = context.attach(extract(headers)) if extract is not None else None
    try:
        return recorder.start_request(ENGINE, model=SETTINGS.model, request_id=external_id, baggage_entries=entries)
    finally:
        if token is not None:
            context.detach(token)


_last_baggage: tuple[Optional[str], Optional[dict]] = (None, None)
"""The last baggage text read and its entries: a batch's requests carry the same baggage."""


def _carried_baggage(text: Optional[str]) -> Optional[dict]:
    """The baggage entries the API process wrote (:data:`BAGGAGE_HEADER`), or ``None``; one dict per
    distinct text in a row, read and never changed by the recorder."""
    global _last_baggage
    if not text:
        return None
    if text == _last_baggage[0]:
        return _last_baggage[1]
    try:
        entries = json.loads(text)
    except ValueError:
        return None
    entries = entries if isinstance(entries, dict) else None
    _last_baggage = (text, entries)
    return entries


def _external_id(internal_id: str) -> str:
    """vLLM's internal ids are ``<external>-<8 random chars>``."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


def judge_hit(record: RequestRecord, blocks: Any, own: list, num_hits: int, hit_blocks: int,
              block_size: int) -> None:
    """The hit blocks' own hashes against the prompt's chain at the same positions: vLLM looked the
    blocks up by that chain, so a block holding another hash holds another prompt's KV.  One list
    comparison of the bare hashes; positions are walked only when they differ."""
    groups = getattr(blocks, "blocks", None)
    held = [b.block_hash for b in groups[0][:hit_blocks]] if groups else []
    if not hit_blocks or len(held) < hit_blocks or None in held:
        record.judge_integrity(sc.LAYER_PREFIX_BLOCKS, num_hits, None, sc.INTEGRITY_HASH_CHAIN_DIFFERS)
        return
    held = bare_hashes(held)
    if held == own[:hit_blocks]:
        record.judge_integrity(sc.LAYER_PREFIX_BLOCKS, num_hits, num_hits, sc.INTEGRITY_HASH_CHAIN_DIFFERS)
        return
    matched = next(i for i, (mine, theirs) in enumerate(zip(own, held)) if mine != theirs)
    foreign = [hash_hex(h) for h in held[matched:]]
    record.judge_integrity(sc.LAYER_PREFIX_BLOCKS, num_hits, matched * block_size, sc.INTEGRITY_HASH_CHAIN_DIFFERS,
                           source=PROVENANCE.source_of(foreign[0]), key_hash=foreign[-1], block_hashes=foreign)


def _hit_block_ids(blocks: Any) -> list[int]:
    """Block ids of the first KV-cache group of a ``KVCacheBlocks`` (prompt order)."""
    groups = getattr(blocks, "blocks", None)
    if not groups:
        return []
    return [int(b.block_id) for b in groups[0]]


def free_request(wrapped, instance, args, kwargs):
    """``Scheduler._free_request(request, ...)``: recorded before vLLM frees it (:mod:`.request_end`)."""
    try:
        request_end.on_free(arg(args, kwargs, 0, "request"))
    except Exception:
        FAILURES.count("free_request")
    return wrapped(*args, **kwargs)
