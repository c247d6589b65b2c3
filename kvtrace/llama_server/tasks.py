"""Requests ↔ llama-server tasks (from its log), what its caches did for each, and whether that state was
the request's own.

A request is tied to its task by what both sides say, never by arrival order alone (docs/proxy.md):

* ``marker``: the proxy set ``dry_penalty_last_n`` (inert while DRY is off) to a number no other
  request in flight has, and the log prints each task's sampling parameters: the task with that
  number is the request's.
* ``timings``: the answer's counts (prompt tokens, computed tokens, generated tokens, and the slot on
  the native endpoint) equal those of exactly one task that started after the request was sent, and
  no other unmarked request still waiting could own that task.
* ``ambiguous``: several tasks fit (two carry the request's marker: another proxy's in front of the same
  server), or another waiting request could own the one that fits; no task and no cache decision is
  attributed. ``none``: no task in the log fits.

For a matched task the state it kept (a prompt-cache restore, or the slot's previous task) is
checked (:class:`PromptChains`): the kept tokens must be the prompt's own prefix as the proxy saw
both requests, and the log's kept count must be the answer's ``cached_tokens``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import msgspec
import numpy as np

from kvtrace import semconv as sc
from kvtrace.json_decode import loads
from kvtrace.llama_server.log import LogFollower, TaskDecision, started_after
from kvtrace.proxy.upstream import UpstreamBrokeOff, UpstreamUnreachable
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin

if TYPE_CHECKING:
    from kvtrace.proxy.app import Traced

log = logging.getLogger("kvtrace.proxy")

MARKER_BASE = 1 << 20
"""Markers are ``MARKER_BASE + n``: far from any ``dry_penalty_last_n`` a client would set."""
MARKER_SPAN = 1 << 16
MARKER_FIELD = "dry_penalty_last_n"


@dataclass(frozen=True)
class Fingerprint:
    """What an answer says about its task (``None``: the answer did not say)."""

    prompt_tokens: Optional[int]
    evaluated_tokens: Optional[int]
    generated_tokens: Optional[int]
    slot: Optional[int]
    ids_in_place: Optional[int] = None
    """Where the answer's logprobs give fewer ids than it generated (llama-server leaves out a token that ends
    inside a UTF-8 character): how many of its ids, from the first, stand where they were generated. ``None``:
    every generated id is given."""

    @property
    def has_timings(self) -> bool:
        return self.evaluated_tokens is not None and self.generated_tokens is not None

    def fits(self, task: TaskDecision) -> bool:
        pairs = ((self.prompt_tokens, task.prompt_tokens), (self.evaluated_tokens, task.evaluated_tokens),
                 (self.generated_tokens, task.generated_tokens), (self.slot, task.slot))
        return all(mine is None or mine == theirs for mine, theirs in pairs)


def fingerprint(response: dict[str, Any], slot: Optional[int]) -> Fingerprint:
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    timings = response.get("timings") if isinstance(response.get("timings"), dict) else {}

    def number(value: Any) -> Optional[int]:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    generated = number(timings.get("predicted_n"))
    return Fingerprint(number(usage.get("prompt_tokens")), number(timings.get("prompt_n")), generated, slot,
                       _ids_in_place(response, generated))


def _ids_in_place(response: dict[str, Any], generated: Optional[int]) -> Optional[int]:
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    given = choice.get("token_ids")
    if generated is None or not isinstance(entries, list) or len(entries) >= generated \
            or (isinstance(given, list) and len(given) >= generated):
        return None
    # The entry after a left-out token carries that token's bytes too, one of them past ASCII (a character
    # begun, not ended); the entries before the first such byte are each their own token's.
    for position, entry in enumerate(entries):
        raw = entry.get("bytes") if isinstance(entry, dict) else None
        text = entry.get("token", "") if isinstance(entry, dict) else ""
        # a bad entry (bytes that are not numbers) counts as past ASCII: the chain stops there, not the record
        if any(not isinstance(b, int) or b >= 0x80 for b in raw) if isinstance(raw, list) else not str(text).isascii():
            return position
    return len(entries)  # left out at the end: a character the answer ended in


class PromptChains:
    """Keyed prefix hashes of each task's state (prompt tokens, then generated ids), bounded.

    Only hashes are kept, in memory, whatever the capture mode: entry ``i`` sums a keyed hash of each
    (position, token) up to ``i`` (modulo 2**64), so two states agree on their first ``n`` tokens exactly
    when entry ``n - 1`` is equal (but for a chance of 2**-64). numpy computes a prompt's chain in a few
    vectorised passes, where a sequential hash per token cost about 1 µs each.
    """

    MAX_TOKENS = 2_000_000
    MAX_TASKS = 4096

    def __init__(self, key: bytes):
        keys = np.frombuffer(hashlib.blake2b(key + b"kvtrace.prompt_chain", digest_size=16).digest(), "<u8")
        self._token_key, self._position_key = keys[0] | np.uint64(1), keys[1] | np.uint64(1)  # odd multipliers
        self._chains: OrderedDict[int, np.ndarray] = OrderedDict()
        self._tokens = 0

    def chain(self, tokens: list[int], after: Optional[np.ndarray] = None) -> np.ndarray:
        """The chain of ``tokens`` (continuing ``after``, the chain of the tokens before them)."""
        start = 0 if after is None else len(after)
        x = (np.asarray(tokens, np.int64).view(np.uint64) * self._token_key
             ^ np.arange(start + 1, start + len(tokens) + 1, dtype=np.uint64) * self._position_key)
        x ^= x >> np.uint64(30)  # splitmix64's finaliser: every input bit moves every output bit
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        chain = np.cumsum(x, dtype=np.uint64)
        if after is None or not len(after):
            return chain
        return np.concatenate([after, chain + after[-1]])

    def keep(self, task: int, chain: np.ndarray) -> None:
        self._chains[task] = chain
        self._tokens += len(chain)
        while self._chains and (self._tokens > self.MAX_TOKENS or len(self._chains) > self.MAX_TASKS):
            _, dropped = self._chains.popitem(last=False)
            self._tokens -= len(dropped)

    def get(self, task: Optional[int]) -> Optional[np.ndarray]:
        return self._chains.get(task) if task is not None else None


def shared_chain_length(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens two chains share from the start (a chain entry equal means every earlier one is)."""
    length = min(len(a), len(b))
    differ = np.flatnonzero(a[:length] != b[:length])
    return int(differ[0]) if len(differ) else length


class _Parked:
    """The rest of a record, waiting for the request of the state its task kept (``source``)."""

    __slots__ = ("source", "then", "deadline")

    def __init__(self, source: int, then: Callable[[], None], deadline: float):
        self.source, self.deadline = source, deadline
        self.then: Optional[Callable[[], None]] = then
        """``None`` once taken to run: the record is let go then, not when its deadline passes."""

    def take(self) -> Callable[[], None]:
        then, self.then = self.then, None
        return then


class TaskProvenance:
    """Ties each traced request to its task in llama-server's log and records what the log says of it."""

    WAIT_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
    """Pauses to wait for the log to show a finished request's task (llama-server writes it from a thread)."""
    REMEMBER_WAIT_S = 2.7
    """How long a record waits for the request of the state its task kept to be remembered (a proxy-marked task's)."""
    MAX_UNCLAIMED = 4096

    def __init__(self, follower: LogFollower,
                 tokenize: Optional[Callable[[dict[str, Any], str], Optional[list[int]]]] = None,
                 lane: tuple[int, int] = (0, 1)):
        self.follower = follower
        self._tokenize = tokenize
        """(request, endpoint) → the prompt's token ids as the server tokenizes them, or ``None``."""
        self._unclaimed: OrderedDict[int, TaskDecision] = OrderedDict()
        # The same tasks, looked up as a request looks for its own: by its marker, or among the unmarked. Another
        # proxy's (or worker's) tasks stay unclaimed here until pushed out; a scan of them all cost a millisecond.
        self._unclaimed_by_marker: dict[int, list[TaskDecision]] = {}
        self._unclaimed_unmarked: OrderedDict[int, TaskDecision] = OrderedDict()
        # Requests sent whose task is not found yet (by id()), and the same counted by marker: every question
        # about them is a lookup, not a scan of them all (a thousand at once held a millisecond a request).
        self._waiting: dict[int, Traced] = {}
        self._waiting_markers: dict[int, int] = {}
        self._waiting_unmarked: dict[int, Traced] = {}
        self._origins: OrderedDict[int, StateOrigin] = OrderedDict()
        self._chains: Optional[PromptChains] = None
        # From a random start: two proxies in front of one server seldom send the same markers at once. The
        # workers of one proxy each take their own lane (index, count): markers n with n % count == index.
        index, lanes = lane
        self._markers = itertools.count(random.randrange(MARKER_SPAN // lanes) * lanes + index, lanes)
        self._unremembered: set[int] = set()  # tasks matched whose request's state is not remembered yet
        self._lock = threading.Lock()  # requests are served by threads of their own
        # Records parked until the request of the state their task kept is remembered or let go, by that task,
        # and in the order their deadlines come (one wait for all: a parked record holds no thread).
        self._parked: dict[int, list[_Parked]] = {}
        self._deadlines: deque[_Parked] = deque()
        self._deadline_due = threading.Condition(self._lock)
        self._deadline_thread: Optional[threading.Thread] = None
        self._running = threading.local()  # the jobs a thread runs one after another (:meth:`_run`)
        self._reading = threading.Lock()  # the log is parsed by one thread at a time; taken before _lock
        self._read_from = -1.0  # when the last read of the log began (time.monotonic())
        self._tasks_seen = False
        self._settings: Optional[tuple[dict[str, Any], dict[str, Any]]] = None  # once a task has started

    # --- the request's way through ---------------------------------------------------------

    def next_marker(self) -> int:
        return MARKER_BASE + next(self._markers) % MARKER_SPAN  # one call into itertools.count: atomic

    def sent(self, traced: Traced) -> None:
        """Just before the request goes upstream: the tasks logged up to where the log ends now cannot be its
        own. Nothing is parsed here, on the client's path: that waits for the answer (:meth:`find`)."""
        traced.sent_at = self.follower.end()
        with self._lock:
            self._wait(traced)

    def abandon(self, traced: Traced) -> None:
        """A request done with (or refused before a task started): it waits for nothing any more."""
        task = traced.task.task if traced.task is not None else None
        if id(traced) not in self._waiting and (task is None or task not in self._unremembered):
            return  # matched (or not) and remembered already: nothing to let go, and no lock taken for it
        with self._lock:
            ready = self._drop(traced)
            if traced.task is not None:
                self._unremembered.discard(traced.task.task)
                ready += self._settled_parked(traced.task.task)
        self._run(ready)

    def server_settings(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(cache settings, numerics) the server's log stated, to be read, never changed. The log states them
        at start-up, so it is read here only until a task has started (the first request's record may be the
        first to read it); from then on every call returns the same pair, copied once, so that a caller may
        keep what it derives from them for as long as the pair is the same object."""
        settled = self._settings
        if settled is not None:
            return settled
        self._poll()
        with self._reading:
            parser = self.follower.parser
            settings = dict(parser.settings), dict(parser.numerics)
            if self._tasks_seen:
                self._settings = settings
            return settings

    def find(self, traced: Traced, answer: Fingerprint) -> None:
        """Ties the request to its task (``traced.task``, ``traced.match``), waiting a little for the log
        to show it and for other waiting requests that could own it to read their answers."""
        traced.answer = answer  # read by the other waiting requests' matches (one store: no lock needed)
        seen = None
        pauses = (0.0, *self.WAIT_S)
        for attempt, pause in enumerate(pauses, 1):
            if pause:
                time.sleep(pause)
            # A read of the log that began after this request's answer was in has every line written before
            # it: records that finish together read the log once between them, not once each.
            self._poll(since=time.monotonic())
            with self._lock:
                outcome, final = self._match(traced, answer)
                # A marker is certain at once; counts only once a second read of the log still says so
                # (the task the answer came from may be a line or two behind in the file).
                if attempt == len(pauses) or final and (traced.marker is not None or outcome == seen):
                    ready = self._settle_match(traced, outcome)
                    break
            seen = outcome if final else None
        self._run(ready)

    def _settle_match(self, traced: Traced, outcome: tuple[str, Optional[TaskDecision]]) -> list[Callable[[], None]]:
        """The match found for ``traced`` (called with ``_lock`` held); the parked records it settles."""
        traced.match, task = outcome
        if task is not None:
            traced.task = task
            self._claim(task.task)
            self._unremembered.add(task.task)
        return self._drop(traced)

    def when_settled(self, traced: Traced, then: Callable[[], None]) -> None:
        """``then()`` once the state ``traced``'s task kept can be read (:meth:`describe`): its request
        remembered or let go, or :data:`REMEMBER_WAIT_S` passed. It runs here when it can at once; else on
        the thread that settles that request (a slot's records one after another, in a loop, where each
        used to wake the next one's thread), or on the deadlines' thread."""
        source = _source_task(traced.task)
        started: Optional[threading.Thread] = None
        now: Optional[Callable[[], None]] = then
        with self._lock:
            if source is not None and not self._settled(source):
                parked = _Parked(source, then, time.monotonic() + self.REMEMBER_WAIT_S)
                self._parked.setdefault(source, []).append(parked)
                self._deadlines.append(parked)
                if self._deadline_thread is None:
                    started = self._deadline_thread = threading.Thread(target=self._expire,
                                                                       name="kvtrace-proxy-deadlines", daemon=True)
                now = None
        if started is not None:
            started.start()  # outside the lock: a start waits for the new thread, which every request would wait for
        if now is not None:
            self._run([now])

    def describe(self, traced: Traced, record: RequestRecord, answer_cached: Optional[int]) -> None:
        """The match, the task's slot and id, its cache decisions and the integrity verdict, on the record
        (called once the state's request is settled: :meth:`when_settled`)."""
        record.config[sc.SERVER_TASK_MATCH] = traced.match or sc.TASK_MATCH_NONE
        decision = traced.task
        if decision is None:
            return
        record.config[sc.SERVER_SLOT_ID] = decision.slot
        record.config[sc.SERVER_SLOT_SELECTED_BY] = decision.selected_by
        record.config[sc.SERVER_SLOT_SIMILARITY] = decision.slot_similarity
        record.config[sc.SERVER_TASK_ID] = decision.task
        restore = decision.restore
        source_task = _source_task(decision)
        origin = self._origins.get(source_task) if source_task is not None else None  # one call: no lock needed
        if restore is not None:
            record.events.append(CacheEvent(
                sc.EVENT_CACHE_RESTORE, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_HIT, tokens=restore.length,
                prefix_tokens=restore.common_prefix, source=origin,
                reason=None if origin is not None else sc.REASON_SOURCE_UNKNOWN))
            if record.reused_tokens > 0:
                record.cache_layer = sc.LAYER_PROMPT_CACHE
                record.state_origin = origin
        elif decision.looked_up:
            record.events.append(CacheEvent(sc.EVENT_CACHE_LOOKUP, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_MISS))
        if restore is None and record.reused_tokens > 0 and origin is not None:
            record.state_origin = origin  # the slot's own state: the request that left it there
        self._verify(traced, record, decision, source_task, origin, answer_cached)

    def remember(self, traced: Traced, record: RequestRecord) -> None:
        """The request's state (prompt, then generated ids) under its task, for the requests that reuse it."""
        if traced.task is None:
            return
        chain, chains = traced.prompt_chain, self._chains
        if chain is not None and chains is not None:
            # The slot's state goes on with the generated ids it evaluated (all but the last), or as far as
            # the answer gives them in place; with ids the server did not report, the chain covers the prompt only.
            engine_ids = record.config.get(sc.OUTPUT_TOKEN_ID_SOURCE) == sc.TOKEN_ID_SOURCE_ENGINE
            in_place = traced.answer.ids_in_place if traced.answer is not None else None
            ids = record.output_token_ids
            generated = (ids[:-1] if in_place is None else ids[:in_place]) if engine_ids else []
            chain = chains.chain(generated, after=chain) if generated else chain
        with self._lock:
            self._origins[traced.task.task] = record.origin()
            while len(self._origins) > 4096:
                self._origins.popitem(last=False)
            if chain is not None and chains is not None:
                chains.keep(traced.task.task, chain)
            self._unremembered.discard(traced.task.task)
            ready = self._settled_parked(traced.task.task)
        self._run(ready)

    # --- records waiting for the request of their state ------------------------------------------

    def _settled(self, task: int) -> bool:
        """Whether ``task``'s request is remembered or let go (called with ``_lock`` held). Unclaimed and
        marked: waited for only while a request of this proxy with that marker waits for its task (a marker
        none of them carries is another proxy's, in front of the same server)."""
        if task in self._unremembered:
            return False
        unclaimed = self._unclaimed.get(task)
        return unclaimed is None or not _is_marker(unclaimed.marker) or unclaimed.marker not in self._waiting_markers

    def _settled_parked(self, task: int) -> list[Callable[[], None]]:
        """The records parked on ``task`` if it is settled now, taken (called with ``_lock`` held)."""
        if task not in self._parked or not self._settled(task):
            return []
        return [entry.take() for entry in self._parked.pop(task)]

    def _expire(self) -> None:
        """The deadlines' thread: runs each parked record whose wait ran out; ends when none is parked."""
        while True:
            with self._lock:
                while True:
                    while self._deadlines and self._deadlines[0].then is None:
                        self._deadlines.popleft()
                    if not self._deadlines:
                        self._deadline_thread = None
                        return
                    wait = self._deadlines[0].deadline - time.monotonic()
                    if wait <= 0:
                        break
                    self._deadline_due.wait(wait)
                due = []
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0].then is None or self._deadlines[0].deadline <= now):
                    entry = self._deadlines.popleft()
                    if entry.then is not None:
                        same = self._parked[entry.source]
                        same.remove(entry)
                        if not same:
                            del self._parked[entry.source]
                        due.append(entry.take())
            self._run(due)

    def _run(self, jobs: list[Callable[[], None]]) -> None:
        """Runs ``jobs``, and the parked records they settle, one after another on this thread: a record run
        here that settles the next one of its slot queues it here, instead of calling it from within itself."""
        if not jobs:
            return
        queue = getattr(self._running, "queue", None)
        if queue is not None:
            queue.extend(jobs)
            return
        queue = self._running.queue = deque(jobs)
        try:
            while queue:
                job = queue.popleft()
                try:
                    job()
                except Exception:  # a job counts its own failures; this guards the jobs queued after it
                    log.warning("kvtrace proxy: a parked record failed", exc_info=True)
        finally:
            self._running.queue = None

    # --- matching -------------------------------------------------------------------------------

    def _poll(self, since: Optional[float] = None) -> None:
        """Parse the log's new lines, unless a read that began at ``since`` or later has (``None``: parse)."""
        with self._reading:
            if since is not None and self._read_from >= since:
                return
            self._read_from = time.monotonic()
            started = self.follower.poll()
            self._tasks_seen = self._tasks_seen or bool(started)
            if not started:
                return
            ready: list[Callable[[], None]] = []
            with self._lock:
                for decision in started:
                    self._claim(decision.task)  # a task id seen again: the server restarted
                    self._unclaimed[decision.task] = decision
                    if _is_marker(decision.marker):
                        self._unclaimed_by_marker.setdefault(decision.marker, []).append(decision)
                    else:
                        self._unclaimed_unmarked[decision.task] = decision
                    while len(self._unclaimed) > self.MAX_UNCLAIMED:
                        pushed_out = next(iter(self._unclaimed))
                        self._claim(pushed_out)
                        ready += self._settled_parked(pushed_out)
        self._run(ready)

    def _claim(self, task: int) -> None:
        """``task`` is no longer unclaimed (called with ``_lock`` held)."""
        decision = self._unclaimed.pop(task, None)
        if decision is None:
            return
        if not _is_marker(decision.marker):
            self._unclaimed_unmarked.pop(task, None)
            return
        same = self._unclaimed_by_marker[decision.marker]
        same.remove(decision)
        if not same:
            del self._unclaimed_by_marker[decision.marker]

    def _wait(self, traced: Traced) -> None:
        """``traced`` waits for its task (called with ``_lock`` held)."""
        self._waiting[id(traced)] = traced
        if traced.marker is None:
            self._waiting_unmarked[id(traced)] = traced
        else:
            self._waiting_markers[traced.marker] = self._waiting_markers.get(traced.marker, 0) + 1

    def _drop(self, traced: Traced) -> list[Callable[[], None]]:
        """``traced`` waits no more (called with ``_lock`` held); the parked records that settles."""
        if self._waiting.pop(id(traced), None) is None:
            return []
        marker = traced.marker
        if marker is None:
            del self._waiting_unmarked[id(traced)]
            return []
        left = self._waiting_markers.pop(marker) - 1
        if left:
            self._waiting_markers[marker] = left
            return []
        # No request of this proxy carries the marker now: its unclaimed tasks are another proxy's.
        ready: list[Callable[[], None]] = []
        for decision in self._unclaimed_by_marker.get(marker, ()):
            ready += self._settled_parked(decision.task)
        return ready

    def _match(self, traced: Traced, answer: Fingerprint) -> tuple[tuple[str, Optional[TaskDecision]], bool]:
        """((how, task), final): final once the log decided; else the outcome if it stays as it is."""
        if traced.marker is not None:
            marked = [t for t in self._unclaimed_by_marker.get(traced.marker, ()) if started_after(t, traced.sent_at)]
            if len(marked) > 1:  # another proxy in front of the same server sent the same marker: not guessed
                return (sc.TASK_MATCH_AMBIGUOUS, None), True
            return ((sc.TASK_MATCH_MARKER, marked[0]), True) if marked else ((sc.TASK_MATCH_NONE, None), False)
        # An unmarked request's task carries no marker of the proxy's, and its timings are out.
        fitting = [t for t in self._unclaimed_unmarked.values() if started_after(t, traced.sent_at)
                   and t.generated_tokens is not None and answer.fits(t)]
        if not fitting:
            return (sc.TASK_MATCH_NONE, None), False
        if len(fitting) > 1:
            return (sc.TASK_MATCH_AMBIGUOUS, None), False
        task = fitting[0]
        # Another waiting request could own it unless its own answer (once read) does not fit the task.
        rivals = [w for w in self._waiting_unmarked.values() if w is not traced and started_after(task, w.sent_at)
                  and (w.answer is None or w.answer.fits(task))]
        if rivals:
            return (sc.TASK_MATCH_AMBIGUOUS, None), False
        return ((sc.TASK_MATCH_TIMINGS if answer.has_timings else sc.TASK_MATCH_LOG), task), True

    # --- integrity ------------------------------------------------------------------------------

    def prepare_chain(self, traced: Traced, key: bytes, endpoint: str) -> Optional[list[int]]:
        """The request's prompt tokens as the server tokenizes them, kept as a hash chain on ``traced``;
        returned too (``None``: not known), for the record where the capture policy lets ids leave."""
        if self._tokenize is None or traced.task is None:
            return None
        try:
            tokens = self._tokenize(traced.request, endpoint)
        except Exception:
            tokens = None  # an answer the proxy cannot read: the state stays unverifiable, the match stands
        if tokens is None or (traced.task.prompt_tokens is not None and len(tokens) != traced.task.prompt_tokens):
            return None  # not the server's tokens: nothing to compare with
        chains = self._chains
        if chains is None:
            with self._lock:
                if self._chains is None:
                    self._chains = PromptChains(key)
                chains = self._chains
        traced.prompt_chain = chains.chain(tokens)
        return tokens

    def _verify(self, traced: Traced, record: RequestRecord, decision: TaskDecision, source_task: Optional[int],
                origin: Optional[StateOrigin], answer_cached: Optional[int]) -> None:
        kept = decision.cached_tokens
        used = kept if kept is not None else answer_cached
        # What the state must share with the prompt: what was kept, and what a restore said it shared.
        claimed = max(used or 0, decision.restore.common_prefix if decision.restore is not None else 0)
        if claimed == 0:
            return  # no state was used: nothing to verify
        violations = []
        if kept is not None and answer_cached is not None and kept != answer_cached:
            violations.append(CacheEvent(sc.EVENT_CACHE_INTEGRITY_VIOLATION, _layer(decision), tokens=answer_cached,
                                         prefix_tokens=kept, reason=sc.INTEGRITY_CACHED_COUNT_DIFFERS, source=origin))
        chains = self._chains  # read without the lock: each lookup is one call into a dict
        state = chains.get(source_task) if chains is not None else None
        mine = traced.prompt_chain
        verdict = sc.INTEGRITY_UNVERIFIABLE
        if state is not None and mine is not None:
            shared = shared_chain_length(state, mine)
            comparable = min(claimed, len(state), len(mine))
            if shared < comparable:
                violations.append(CacheEvent(sc.EVENT_CACHE_INTEGRITY_VIOLATION, _layer(decision), tokens=claimed,
                                             prefix_tokens=shared, reason=sc.INTEGRITY_FOREIGN_PROMPT, source=origin))
            elif comparable == claimed:
                verdict = sc.INTEGRITY_VERIFIED
        if violations:
            verdict = sc.INTEGRITY_VIOLATED
            record.events.extend(violations)
        if record.cache_integrity != sc.INTEGRITY_VIOLATED:  # as RequestRecord.judge_integrity: a violation stays
            record.cache_integrity = verdict


def _layer(decision: TaskDecision) -> str:
    return sc.LAYER_PROMPT_CACHE if decision.restore is not None else sc.LAYER_KV_REUSE


def _source_task(decision: Optional[TaskDecision]) -> Optional[int]:
    """The task whose state ``decision``'s task kept: the restored prompt's, else the slot's previous one."""
    if decision is None:
        return None
    return decision.restore.source_task if decision.restore is not None else decision.previous_task


def _is_marker(value: Optional[int]) -> bool:
    return value is not None and MARKER_BASE <= value < MARKER_BASE + MARKER_SPAN


# --- the prompt's tokens, as the server makes them ---------------------------------------------------

_encode = msgspec.json.encode  # in C, a fifth of json.dumps' time; a lone surrogate raises, as json's UTF-8 did
CHAT_TEMPLATE_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_format")
TOKENIZED_TOKENS = 2_000_000
"""Token ids of the prompts the server tokenized, kept for the next request with the same prompt (a shadow
twin, a repeat of an experiment, a client's retry): two upstream calls saved each, 16 MB at most."""


class _Tokenized:
    """The server's token ids per prompt (keyed by a hash of what it renders), the oldest let go first."""

    def __init__(self, max_tokens: int):
        self._max_tokens = max_tokens
        self._tokens = 0
        self._kept: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Optional[np.ndarray]:
        with self._lock:
            ids = self._kept.get(key)
            if ids is not None:
                self._kept.move_to_end(key)
            return ids

    def keep(self, key: bytes, ids: np.ndarray) -> None:
        with self._lock:
            if key in self._kept or len(ids) > self._max_tokens:
                return
            self._kept[key] = ids
            self._tokens += len(ids)
            while self._tokens > self._max_tokens:
                _, dropped = self._kept.popitem(last=False)
                self._tokens -= len(dropped)


def server_tokenizer(post: Callable[[str, dict[str, Any]], Optional[dict[str, Any]]],
                     max_tokens: int = TOKENIZED_TOKENS):
    """A ``tokenize`` for :class:`TaskProvenance` that asks the server itself (``/apply-template``, ``/tokenize``).

    ``post(path, body)``: the server's JSON answer, or ``None``. The server renders and tokenizes a chat
    prompt the way its chat endpoint does, so the ids are those the slot holds. A prompt asked again is
    answered from what the server said the first time (the proxy serves one server for its life, as its
    profile of it says).
    """
    tokenized = _Tokenized(max_tokens)

    def tokenize(request: dict[str, Any], endpoint: str) -> Optional[list[int]]:
        if endpoint == "chat":
            fields = {k: request[k] for k in CHAT_TEMPLATE_FIELDS if k in request}
            key = b"chat" + hashlib.blake2b(_encode(fields, order="sorted"), digest_size=16).digest()
        else:
            text = request.get("prompt")
            if isinstance(text, list) and all(isinstance(t, int) for t in text):
                return list(text)
            if not isinstance(text, str):
                return None
            key = b"text" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        known = tokenized.get(key)
        if known is not None:
            return known.tolist()  # a list of its own: the record may keep it
        if endpoint == "chat":
            rendered = post("/apply-template", fields)
            text = rendered.get("prompt") if isinstance(rendered, dict) else None
            if not isinstance(text, str):
                return None
        answer = post("/tokenize", {"content": text, "add_special": True, "parse_special": True})
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        tokenized.keep(key, np.asarray(tokens, np.int64))  # 8 bytes a token, where a list of ints takes 36
        return tokens

    return tokenize


def json_post(upstream) -> Callable[[str, dict[str, Any]], Optional[dict[str, Any]]]:
    """``post`` for :func:`server_tokenizer` over the proxy's upstream connections."""
    def post(path: str, body: dict[str, Any]) -> Optional[dict[str, Any]]:
        data = _encode(body)
        for _ in range(2):  # these calls change nothing, so one the server closed on is sent again
            try:
                status, raw = upstream.post_json(path, data, timeout=30.0)
            except (UpstreamUnreachable, UpstreamBrokeOff):
                continue
            try:
                return loads(raw) if status == 200 else None
            except ValueError:
                return None
        return None

    return post
