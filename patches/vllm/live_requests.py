"""The engine core's registry of the requests it is recording.

vLLM's scheduler, KV-cache manager, block pool and sampler each see part of a request; they meet
here, keyed by vLLM's internal request id.  A request is *live* from its admission
(``record_prefix_cache_stats``) until vLLM frees it; cache events that belong to it but happen
before its admission (blocks stored or evicted while its slots are allocated) wait here until then.
A request freed while its last rows are still on the device is *ending*: it still takes rows until
:mod:`.request_end` finishes it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from kvtrace.recording.records import CacheEvent, RequestRecord
from kvtrace.recording.recorder import Recorder

if TYPE_CHECKING:  # the row modules import this one
    from kvtrace.patches.vllm.row_stats import SampledRow


@dataclass
class LiveRequest:
    """A request the engine core admitted and has not finished."""

    recorder: Recorder
    record: RequestRecord
    sampled_rows: list[SampledRow] = field(default_factory=list)
    """One per generated token, in order."""
    row_steps: list[tuple] = field(default_factory=list)
    """Parallel to ``sampled_rows``: the step each came from, ``(rows, tokens, this row's tokens)`` (all 0
    when unknown); the first one's row tokens are the prompt's last prefill chunk."""
    partial_prefills: list[int] = field(default_factory=list)
    """The prompt's computed tokens in each step before the one that sampled the first token (0 when
    unknown)."""
    ending: Any = None
    """Once vLLM freed it while rows were still on the device: what :mod:`.request_end` finishes it with."""


class LiveRequests:
    """Live requests, the lookups and events waiting for their admission, and engine-wide events.

    One lock guards all of it: the sampler may hand rows over from another thread than the
    scheduler's.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[str, LiveRequest] = {}
        self._lookups: dict[str, Any] = {}  # internal id → KVCacheBlocks of the last prefix-cache lookup
        self._early: dict[str, list[CacheEvent]] = {}  # internal id → events before its admission
        self._engine_events: list[CacheEvent] = []  # e.g. resets: shown on the next admitted request
        self._ending: dict[str, LiveRequest] = {}  # freed by vLLM, waiting for rows still on the device

    def __bool__(self) -> bool:
        return bool(self._live)

    def get(self, internal_id: str) -> Optional[LiveRequest]:
        with self._lock:
            return self._live.get(internal_id)

    def note_lookup(self, internal_id: str, blocks: Any) -> None:
        """vLLM may look a waiting request up more than once; the last lookup before admission counts."""
        with self._lock:
            self._lookups[internal_id] = blocks

    def take_lookup(self, internal_id: str) -> Any:
        with self._lock:
            return self._lookups.pop(internal_id, None)

    def admit(self, internal_id: str, request: LiveRequest, lookup: CacheEvent) -> list[CacheEvent]:
        """Make ``request`` live.  Its events start with the engine events since the last admission,
        then its lookup, then the events charged to it before now (returned, for their stores)."""
        with self._lock:
            events = request.record.events
            events.extend(self._engine_events)
            self._engine_events.clear()
            events.append(lookup)
            early = self._early.pop(internal_id, [])
            events.extend(early)
            self._live[internal_id] = request
        return early

    def charge(self, internal_id: Optional[str], event: CacheEvent) -> Optional[LiveRequest]:
        """Attach ``event`` to the request that caused it, or keep it until that request is admitted.

        Returns the live request it was attached to (``None`` when kept or when no request is named).
        """
        if internal_id is None:
            return None
        with self._lock:
            live = self._live.get(internal_id)
            if live is not None:
                live.record.events.append(event)
            else:
                self._early.setdefault(internal_id, []).append(event)
            return live

    def note_engine_event(self, event: CacheEvent) -> None:
        with self._lock:
            self._engine_events.append(event)

    def add_rows(self, req_ids: Iterable[str], rows: Iterable[SampledRow], steps: Iterable[tuple]) -> None:
        """Append to each live request its row of a step and that step's shape (per row, as
        :func:`~kvtrace.patches.vllm.sampler.row_steps` gives them), in ``req_ids``' order (the longest
        is cut); a row that sampled no token adds only its prompt chunk, and rows of requests not
        recorded here are dropped."""
        with self._lock:
            live_requests = self._live
            for internal_id, row, step in zip(req_ids, rows, steps):
                live = live_requests.get(internal_id)
                if live is None:
                    live = self._ending.get(internal_id) if self._ending else None
                    if live is None:
                        continue
                if row.sampled > 0.5:  # read in place: this runs once per generated token
                    live.sampled_rows.append(row)
                    live.row_steps.append(step)
                elif not live.sampled_rows:  # a partial prefill (not a recompute after a preemption)
                    live.partial_prefills.append(step[2])

    def end(self, internal_id: str, ending: Any) -> Optional[LiveRequest]:
        """Stop tracking a request vLLM frees; returns it when it was live.  A live one moves to the
        ending requests in one step, so rows a drain on another thread hands over meanwhile still reach
        it, and stays there, with ``ending``, until :meth:`take_endings` gives it back."""
        with self._lock:
            self._early.pop(internal_id, None)
            self._lookups.pop(internal_id, None)
            live = self._live.pop(internal_id, None)
            if live is not None:
                live.ending = ending
                self._ending[internal_id] = live
            return live

    def take_endings(self, ready: Callable[[LiveRequest], bool]) -> list[LiveRequest]:
        """The ending requests ``ready`` says can be finished now, no longer held."""
        if not self._ending:
            return []
        with self._lock:
            done = [i for i, live in self._ending.items() if ready(live)]
            return [self._ending.pop(i) for i in done]

    @property
    def ending_count(self) -> int:
        return len(self._ending)

    def clear(self) -> None:
        with self._lock:
            self._ending.clear()
            self._live.clear()
            self._lookups.clear()
            self._early.clear()
            self._engine_events.clear()


LIVE = LiveRequests()
