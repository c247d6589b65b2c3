"""llama-server's own log → what it decided about each task's prompt before processing it.

llama-server logs, per task, which slot it chose and why (``selected slot by LCP similarity`` /
``by LRU`` / ``by id``), and, with its host-memory prompt cache on (``--cache-ram``, the default),
which cached prompt it restored into the slot: ``saving prompt with length L`` (the slot's previous
state goes into the cache), ``looking for better prompt`` with one line per cached prompt
(``length, lcp, f_keep, f_sim``) and ``found better prompt with f_keep, f_sim`` (the one restored).
The cache lines are at trace level: start llama-server with ``-lv 4`` (or ``--verbose``) and
``--log-file FILE`` (or its standard error in a file).

Per task the log also says what an answer reports back, which is how a request is told from the
others in flight (:mod:`kvtrace.llama_server.tasks`): the sampling parameters the task runs with (among
them ``dry_penalty_last_n``, which the proxy may set as a marker), ``task.n_tokens``, ``cached
n_tokens`` (the tokens kept from the slot's state), and the evaluated and generated counts of its
timing lines.

:class:`LogFollower` reads those lines in order and keeps a model of the cache — which task's state
each cached prompt is — so that a restore names the earlier *task* whose state came back. Where
the log leaves a doubt (two cached prompts of the same length and similarity, a cache entry the
model did not see stored), the decision says so (``source_task`` ``None`` and ``doubt``) instead of
guessing. Matching tasks to HTTP requests is :mod:`kvtrace.llama_server.tasks`'s business.

After every cache update llama-server lists every cached prompt, and a lookup logs each as a
candidate, so with a large cache most of the log is these lines (thousands a request). A listing
line that repeats a model entry as printed is passed over without a parse (the few new ones are
parsed as before), and candidates are parsed only for a lookup that restores one.
"""

from __future__ import annotations

import io
import operator
import os
import re
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Optional

from kvtrace import semconv as sc

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Screened:
    """A pattern searched only in lines that hold its literal part: most lines of a verbose log match
    none of the patterns, and a substring test costs a fraction of a search."""

    __slots__ = ("literal", "pattern")
    literals: list[str] = []
    """Every pattern's literal part: each holds one of ``SCREEN_WORDS`` (a test keeps it so)."""

    def __init__(self, literal: str, regex: str):
        self.literal, self.pattern = literal, re.compile(regex)
        _Screened.literals.append(literal)

    def search(self, line: str) -> Optional[re.Match]:
        return self.pattern.search(line) if self.literal in line else None


_SLOT = r"id\s+(?P<slot>\d+) \| task (?P<task>-?\d+) \| "
_SELECTED = _Screened("selected slot by ", _SLOT + r"selected slot by (?P<how>LCP similarity|LRU|id)"
                                               r"(?:, f_sim_best = (?P<sim>[\d.]+))?")
_DRY_LAST_N = _Screened("dry_penalty_last_n = ", r"^\s+.*\bdry_penalty_last_n = (?P<n>-?\d+)")
_CONTEXT = _Screened("llama_context: ", r"llama_context: (?P<name>n_ctx|n_batch|n_ubatch)\s+= (?P<value>\d+)")
_FLASH_SET = _Screened("llama_context: flash_attn", r"llama_context: flash_attn\s+= (?P<value>enabled|disabled)")
_FLASH_RESOLVED = _Screened("Flash Attention ", r"Flash Attention (?P<value>enabled|disabled)")
_KV_TYPES = _Screened("llama_kv_cache: size = ", r"llama_kv_cache: size = .* K \((?P<k>\w+)\).* V \((?P<v>\w+)\)")
_THREADS = _Screened("system_info: n_threads = ",
                     r"system_info: n_threads = (?P<n>\d+) \(n_threads_batch = (?P<batch>\d+)\) / \d+ \| (?P<info>.*)")
_REPACKED = re.compile(r"load_tensors: +\S*(REPACK|AMX)\S* model buffer size")
_TENSORS = _Screened("load_tensors: ", r"load_tensors: ")
_CACHE_ON = _Screened("prompt cache is enabled, size limit: ",
                      r"prompt cache is enabled, size limit: (?:(?P<mib>\d+) MiB|no limit)")
_CACHE_OFF = _Screened("prompt cache is disabled", r"prompt cache is disabled")
_IDLE_SAVE = _Screened("saving idle slot to prompt cache", _SLOT + r"saving idle slot to prompt cache")
_SAVING = _Screened("- saving prompt with length ", r"- saving prompt with length (?P<n>\d+)")
_ALREADY = _Screened("- prompt is already in the cache, skipping", r"- prompt is already in the cache, skipping")
_TOO_BIG = _Screened("exceeds cache size limit", r"- prompt state size .* exceeds cache size limit")
_OBSOLETE = _Screened("- removing obsolete cached prompt with length ",
                      r"- removing obsolete cached prompt with length (?P<n>\d+)")
_OLDEST = _Screened("removing oldest entry", r"removing oldest entry")
_LOOKING = _Screened("- looking for better prompt", r"- looking for better prompt")
_CANDIDATE = _Screened("- prompt with length", r"- prompt with length\s+(?P<n>\d+), lcp =\s+(?P<lcp>\d+), "
                                              r"f_keep = (?P<keep>[\d.]+), f_sim = (?P<sim>[\d.]+)")
_CACHE_STATE = _Screened("- cache state: ", r"- cache state: (?P<n>\d+) prompts")
_LISTED = _Screened("- prompt ", r"- prompt (?P<address>(?:0x)?[0-9a-fA-F]+):\s+(?P<n>\d+) tokens")
_LISTED_TEXT = operator.attrgetter("listed")
_FOUND = _Screened("- found better prompt with f_keep = ",
                   r"- found better prompt with f_keep = (?P<keep>[\d.]+), f_sim = (?P<sim>[\d.]+)")
SCREEN_WORDS = ("prompt", "cache", "selected slot", "dry_penalty", "llama_", "Flash Attention", "system_info",
                "load_tensors", "removing")
"""Every pattern's literal holds one of these words (a test keeps it so): about half the lines of a -lv 4 log
hold none and are passed over at once (0.75 µs a line, where one regex over every literal took 1.4–4.1)."""

SELECTED_BY = {"LCP similarity": sc.SLOT_SELECTED_BY_LCP_SIMILARITY, "LRU": sc.SLOT_SELECTED_BY_LRU,
               "id": sc.SLOT_SELECTED_BY_ID}

_TASK_LINE = "| task "
"""In every line of a task's own messages (the slot's prefix): those are sought only in lines holding it."""
_TASK_MESSAGE = re.compile(r"id\s+(\d+) \| task (-?\d+) \| (?:"
                           r"(processing task)"  # the task starts on the slot
                           r"|new prompt, .*task\.n_tokens = (\d+)"  # its prompt's tokens
                           r"|cached n_tokens = (\d+)"  # the tokens of the slot's state it kept
                           r"|prompt eval time = .*/\s*(\d+) tokens"  # the prompt tokens it computed
                           r"|\s*eval time = .*/\s*(\d+) tokens"  # the tokens it generated
                           r"|(sampler params:)"  # its sampling parameters follow (the marker among them)
                           r"|stop processing: n_tokens = (\d+))")  # the slot's state it leaves
"""The messages every task logs as it runs, in one search: (slot, task, then the one message's group). Each
proxy reading a log parses every task's lines, other proxies' and workers' too; one search costs about a third
of the screening, a rule's literal tests and its own search."""
_STARTED, _PROMPT_SIZE, _KEPT, _EVALUATED, _GENERATED, _PARAMETERS, _RELEASE = range(3, 10)


@dataclass
class Restore:
    """A cached prompt llama-server restored into the slot before the task (its prompt cache)."""

    length: int
    """Tokens of the restored state."""
    common_prefix: int
    """Tokens it shares with the task's prompt (``lcp``)."""
    similarity: float
    """``f_sim``: the shared prefix over the task's prompt length."""
    kept: float
    """``f_keep``: the shared prefix over the restored state's length."""
    source_task: Optional[int] = None
    """The earlier task whose state this was; ``None`` when the log cannot say (see ``doubt``)."""
    doubt: Optional[str] = None


@dataclass
class TaskDecision:
    """What the server decided for one task before processing it."""

    task: int
    slot: int
    selected_by: Optional[str] = None
    slot_similarity: Optional[float] = None
    restore: Optional[Restore] = None
    looked_up: bool = False
    """The server looked in its prompt cache for this task (``restore`` says what it found)."""
    prompt_tokens: Optional[int] = None
    """``task.n_tokens`` (filled when the server logs the new prompt, after the decision)."""
    marker: Optional[int] = None
    """``dry_penalty_last_n`` of the task's sampling parameters (the proxy's marker, where it set one)."""
    previous_task: Optional[int] = None
    """Without a restore: the task whose state the slot still held (``None``: an empty or unknown state)."""
    cached_tokens: Optional[int] = None
    """``cached n_tokens``: the tokens of the slot's state the task kept (its first such line)."""
    evaluated_tokens: Optional[int] = None
    """The prompt tokens the task computed (its ``prompt eval time`` line: an answer's ``prompt_n``)."""
    generated_tokens: Optional[int] = None
    """The tokens the task generated (its ``eval time`` line: ``predicted_n``); set once its timings are out."""
    logged_at: tuple[int, int] = (0, 0)
    """Where the line that started it ends in the log: (the file's inode, bytes up to its newline)."""


@dataclass(eq=False)  # an entry is itself, not any entry of its length and origin (and `in` stays cheap)
class _CachedPrompt:
    length: int
    source_task: Optional[int]
    address: Optional[str] = None
    """Where llama-server keeps it, as its cache listing prints it (the entry's identity between listings)."""
    listed: str = "\n"
    """What a line of the listing says of it once its address is known: a line holding this repeats it (no
    line holds a newline)."""

    def learn(self, address: str) -> None:
        self.address, self.listed = address, f"- prompt {address}: {self.length:7d} tokens"


@dataclass
class _Pending:
    """Lines seen since the last task started: they belong to the next one."""

    slot: Optional[int] = None
    selected_by: Optional[str] = None
    similarity: Optional[float] = None
    candidate_lines: list[str] = field(default_factory=list)
    """The lookup's "- prompt with length" lines, read only if it restores one (every cached prompt is one)."""
    looked_up: bool = False
    restore: Optional[Restore] = None


class LogParser:
    """Feed it llama-server's log lines in order; it returns a :class:`TaskDecision` per started task."""

    def __init__(self) -> None:
        self._pending = _Pending()
        self._cache: list[_CachedPrompt] = []  # oldest first, as llama-server keeps it
        self._last_task_of_slot: dict[int, int] = {}
        self._state_length_of_slot: dict[int, int] = {}
        self._storing: Optional[_CachedPrompt] = None
        self._idle_slot: Optional[int] = None  # an idle slot being saved (--cache-idle-slots)
        self._reading_listing = False  # the cache listing's lines are coming
        self._listing_size = 0
        self._listing_seen = 0
        self._listing: Optional[list[tuple[str, int]]] = None  # the listing whole, once it left the model's order
        self._learned: dict[int, str] = {}  # while in order: the new addresses the listing gives, by position
        self._alike: Optional[tuple[Restore, list[_CachedPrompt]]] = None  # a restore the next listing decides
        self._restored_entry: Optional[_CachedPrompt] = None
        self._params_slot: Optional[int] = None  # the slot whose sampling parameters are being printed
        self._marker_of_slot: dict[int, int] = {}
        self.decisions: dict[int, TaskDecision] = {}
        self.settings: dict[str, object] = {}
        """Server settings the log states at start-up (``cache_ram_mib``: the prompt cache's limit, -1 none)."""
        self.numerics: dict[str, object] = {}
        """What changes numerics, as the in-process patch records it (``n_batch``, ``flash_attn``, ``type_k`` ...)."""

    def feed(self, line: str) -> Optional[TaskDecision]:
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        # A log line is one message: a task's own is told by its slot prefix and read at once.
        if _TASK_LINE in line and (m := _TASK_MESSAGE.search(line)) is not None:
            return self._task_message(m)
        if self._params_slot is not None and _DRY_LAST_N.literal in line \
                and (m := _DRY_LAST_N.pattern.search(line)) is not None:
            # A line of the parameters block (one log entry, so no other line comes between).
            self._marker_of_slot[self._params_slot] = int(m["n"])
            self._params_slot = None
            return None
        if not any([word in line for word in SCREEN_WORDS]):
            return None
        pending = self._pending
        if "- prompt " in line:
            # First: llama-server lists its whole cache after every update, and every cached prompt as a
            # lookup's candidate, so with a large cache most lines are these two.
            if self._reading_listing and (m := _LISTED.pattern.search(line)) is not None:
                address, length = m.groups()  # one call: by name, a listing line's groups cost a third more
                self._listed(address, int(length))
                return None
            if _CANDIDATE.literal in line:
                pending.candidate_lines.append(line)
                return None
        if (m := _SELECTED.search(line)) is not None:
            self._idle_slot = None  # an empty idle slot saves nothing
            pending.slot, pending.selected_by = int(m["slot"]), SELECTED_BY[m["how"]]
            pending.similarity = float(m["sim"]) if m["sim"] else None
        elif (m := _SAVING.search(line)) is not None:
            self._saving(int(m["n"]))
        elif _ALREADY.search(line) or _TOO_BIG.search(line):
            if self._storing is not None and self._storing in self._cache:
                self._cache.remove(self._storing)  # `_saving` assumed it would be stored; it was not
            self._storing = None
        elif (m := _OBSOLETE.search(line)) is not None:
            self._drop_length(int(m["n"]))
        elif _OLDEST.search(line):
            if self._cache:
                self._cache.pop(0)  # never the one being stored: llama-server makes room before adding it
        elif _LOOKING.search(line):
            pending.candidate_lines, pending.looked_up, self._storing, self._idle_slot = [], True, None, None
        elif (m := _CACHE_STATE.search(line)) is not None:
            self._reading_listing, self._listing_size, self._listing_seen = True, int(m["n"]), 0
            self._listing, self._learned = ([] if self._alike is not None else None), {}
            if self._listing_size == 0:
                self._reconcile()
        elif (m := _IDLE_SAVE.search(line)) is not None:
            self._idle_slot = int(m["slot"])
        elif (m := _FOUND.search(line)) is not None:
            pending.restore = self._restored(m["keep"], m["sim"])
        elif (m := _CONTEXT.search(line)) is not None:
            self.numerics[m["name"]] = int(m["value"])
        elif (m := _FLASH_SET.search(line) or _FLASH_RESOLVED.search(line)) is not None:
            self.numerics["flash_attn"] = m["value"]
        elif (m := _KV_TYPES.search(line)) is not None:
            self.numerics["type_k"], self.numerics["type_v"] = m["k"], m["v"]
        elif (m := _THREADS.search(line)) is not None:
            self.numerics.update(n_threads=int(m["n"]), n_threads_batch=int(m["batch"]),
                                 system_info=m["info"].strip()[:500])
        elif _TENSORS.search(line):
            # Repacked weights (AMX and other extra buffer types) run other kernels, hence other numerics.
            self.numerics["weight_repack"] = bool(_REPACKED.search(line)) or bool(self.numerics.get("weight_repack"))
        elif (m := _CACHE_ON.search(line)) is not None:
            self.settings["cache_ram_mib"] = int(m["mib"]) if m["mib"] else -1
        elif _CACHE_OFF.search(line):
            self.settings["cache_ram_mib"] = 0
        return None

    def _task_message(self, m: re.Match) -> Optional[TaskDecision]:
        """One of the messages a task logs as it runs (:data:`_TASK_MESSAGE`'s groups)."""
        kind, slot, task = m.lastindex, int(m[1]), int(m[2])
        if kind == _STARTED:
            return self._started(slot, task)
        if kind == _PARAMETERS:
            self._params_slot = slot
        elif kind == _RELEASE:
            self._last_task_of_slot[slot] = task
            self._state_length_of_slot[slot] = int(m[kind])
        elif (decision := self.decisions.get(task)) is not None:
            if kind == _PROMPT_SIZE:
                decision.prompt_tokens = int(m[kind])
            elif kind == _KEPT:
                # The first line says what was kept; later ones report progress through the prompt's batches.
                if decision.cached_tokens is None:
                    decision.cached_tokens = int(m[kind])
            elif kind == _EVALUATED:
                decision.evaluated_tokens = int(m[kind])
            else:
                decision.generated_tokens = int(m[kind])
        return None

    def _saving(self, length: int) -> None:
        # The slot's state goes into the cache: that of the last task the slot finished, if its length
        # is the one the slot had then (otherwise the slot's state is one the log did not follow).
        slot = self._idle_slot if self._idle_slot is not None else self._pending.slot
        self._idle_slot = None
        source = self._last_task_of_slot.get(slot) if slot is not None else None
        if slot is None or self._state_length_of_slot.get(slot) != length:
            source = None
        # Appended now, removed again if llama-server says it did not store it. The obsolete and
        # oldest entries it drops before storing are logged after this line and are older ones.
        self._storing = _CachedPrompt(length, source)
        self._cache.append(self._storing)

    @property
    def listing_left(self) -> int:
        """Lines of the cache's listing still to come (0 outside one)."""
        return self._listing_size - self._listing_seen if self._reading_listing else 0

    def feed_listing(self, lines: list[str]) -> int:
        """Reads at once the lines of the cache's listing that ``lines`` (at most ``listing_left``) begins with:
        with a large cache nearly all of a log is these. Returns how many it read: 0 where the block holds
        a line of another kind, which is then for :meth:`feed`, line by line."""
        if self._listing is None:
            # Most lines repeat the model's entries, addresses and lengths as llama-server prints them: those
            # are passed over without a parse, up to the first line that does not (a new entry, another line).
            entries = self._cache[self._listing_seen:self._listing_seen + len(lines)]
            same = list(map(str.__contains__, lines, map(_LISTED_TEXT, entries)))
            held = same.index(False) if False in same else len(same)
            if held:
                self._listing_seen += held
                if self._listing_seen == self._listing_size:
                    self._reconcile()
                return held
        found = list(map(_LISTED.pattern.search, lines))
        if None in found:
            return 0
        for m in found:
            address, length = m.groups()
            self._listed(address, int(length))
        return len(found)

    def _listed(self, address: str, length: int) -> None:
        """One line of the listing. Most listings repeat the model, so each line is compared as it comes
        and nothing of it is kept; only a listing that leaves the model's order is kept whole."""
        index = self._listing_seen
        self._listing_seen += 1
        if self._listing is None:
            entry = self._cache[index] if index < len(self._cache) else None
            if entry is not None and entry.length == length:
                if entry.address != address:  # an equal one stays: a listing's strings are short-lived
                    self._learned[index] = address
            else:
                self._listing = self._listing_so_far(index) + [(address, length)]
        else:
            self._listing.append((address, length))
        if self._listing_seen == self._listing_size:
            self._reconcile()

    def _listing_so_far(self, count: int) -> list[tuple[str, int]]:
        """The listing's first ``count`` lines, which repeated the model's first entries."""
        return [(self._learned.get(i, entry.address) or "", entry.length) for i, entry in enumerate(self._cache[:count])]

    def _reconcile(self) -> None:
        """The model of the cache against llama-server's own listing of it (after every cache update).

        Lengths in the same order: the model holds, and learns each entry's address. Otherwise the
        listing wins: an entry keeps its origin only where its address (and length) or, for one not
        listed before, a single model entry of its length says which it is.
        """
        listed, self._listing, self._reading_listing = self._listing, None, False
        restored, self._restored_entry = self._restored_entry, None
        if listed is None and self._listing_seen == len(self._cache):
            for index, address in self._learned.items():
                self._cache[index].learn(address)
            return
        if listed is None:  # in order, but shorter than the model
            listed = self._listing_so_far(self._listing_seen)
        if self._alike is not None:
            restore, alike = self._alike
            self._alike = None
            addresses = {address for address, _ in listed}
            gone = [entry for entry in alike if entry.address is not None and entry.address not in addresses]
            if len(gone) == 1 and all(entry.address is not None for entry in alike):
                restore.source_task = gone[0].source_task
                restore.doubt = None if gone[0].source_task is not None else \
                    "the cached prompt was stored from a state the log did not follow"
                self._cache.remove(gone[0])
        if [entry.length for entry in self._cache] == [length for _, length in listed]:
            for entry, (address, _) in zip(self._cache, listed):
                if entry.address != address:  # an equal one stays: a listing's strings are short-lived
                    entry.learn(address)
            return
        # The entry last restored counts among the model's: a listing that still shows it (a log that
        # contradicts itself) keeps its origin.
        known = self._cache + ([restored] if restored is not None else [])
        by_address = {entry.address: entry for entry in known if entry.address}
        unlisted = [entry for entry in known if entry.address is None]
        rebuilt = []
        for address, length in listed:
            entry = by_address.get(address)
            if entry is None or entry.length != length:
                alike = [e for e in unlisted if e.length == length]
                entry = alike[0] if len(alike) == 1 else _CachedPrompt(length, None)
                if entry in unlisted:
                    unlisted.remove(entry)
            if entry.address != address:
                entry.learn(address)
            rebuilt.append(entry)
        self._cache = rebuilt

    def _drop_length(self, length: int) -> None:
        # llama-server drops the cached prompt the new state contains; the line gives only its length,
        # so where several have it the model cannot say which went, nor whose the others are.
        alike = [entry for entry in self._cache if entry.length == length and entry is not self._storing]
        if not alike:
            return
        self._cache.remove(alike[0])
        if len(alike) > 1:
            for entry in alike[1:]:
                entry.source_task = None

    def _restored(self, keep: str, sim: str) -> Restore:
        candidates = [(int(m["n"]), int(m["lcp"]), m["keep"], m["sim"]) for line in self._pending.candidate_lines
                      if (m := _CANDIDATE.search(line)) is not None]
        chosen = [c for c in candidates if (c[2], c[3]) == (keep, sim)]
        if not chosen:
            return Restore(0, 0, float(sim), float(keep), doubt="the restored prompt is not among the logged ones")
        length, common_prefix = chosen[-1][0], chosen[-1][1]
        restore = Restore(length, common_prefix, float(sim), float(keep))
        if len(chosen) > 1:
            restore.doubt = f"{len(chosen)} cached prompts have the same length and similarity"
            if len(candidates) == len(self._cache):
                # The listing that follows shows which of them left the cache: that one was restored.
                self._alike = (restore, [self._cache[i] for i, c in enumerate(candidates) if (c[2], c[3]) == (keep, sim)
                                         and c[0] == length])
            return restore
        index = candidates.index(chosen[-1])
        if len(candidates) != len(self._cache) or self._cache[index].length != length:
            restore.doubt = "the cache held prompts the log did not show being stored"
            matching = [e for e in self._cache if e.length == length]
            if len(matching) == 1:
                restore.source_task, restore.doubt = matching[0].source_task, None
                self._cache.remove(matching[0])
            return restore
        entry = self._cache.pop(index)
        self._restored_entry = entry
        restore.source_task = entry.source_task
        if entry.source_task is None:
            restore.doubt = "the cached prompt was stored from a state the log did not follow"
        return restore

    def _started(self, slot: int, task: int) -> TaskDecision:
        pending = self._pending
        decision = TaskDecision(task, slot, marker=self._marker_of_slot.pop(slot, None))
        if pending.slot == slot:
            decision.selected_by, decision.slot_similarity = pending.selected_by, pending.similarity
            decision.restore, decision.looked_up = pending.restore, pending.looked_up
            if decision.restore is not None:
                # The restored state is now the slot's: a later save of this slot stores it again.
                self._state_length_of_slot[slot] = decision.restore.length
        if decision.restore is None:
            decision.previous_task = self._last_task_of_slot.get(slot)
        self._pending = _Pending()
        self.decisions[task] = decision
        while len(self.decisions) > 4096:
            self.decisions.pop(next(iter(self.decisions)))
        return decision


class LogFollower:
    """Reads a growing log file from where it last stopped (``tail -f`` without the waiting)."""

    def __init__(self, path: Path, parser: Optional[LogParser] = None):
        self.path = Path(path)
        self.parser = parser or LogParser()
        self._offset = 0
        self._partial = b""
        self._inode: Optional[int] = None
        self._file: Optional[io.FileIO] = None  # kept open between polls: most find a few lines, or none

    READ_BYTES = 1 << 16
    """Read and parsed a piece at a time: a log far ahead (a proxy started on a long-running server,
    llama-server listing a large cache) never sits in memory whole. Small pieces keep each parse's
    short-lived lines few: a megabyte of them at once left memory that the proxy's longer-lived
    objects, made meanwhile, then held (RSS grew 19 KB a request with 1 MiB pieces, 6.5 with 64 KiB)."""

    def poll(self) -> list[TaskDecision]:
        """Parse the lines written since the last call; returns the tasks that started in them. The name is
        looked at (a system call) only when the open file has nothing new: then it may name another file by
        now, or this one may have been truncated (a server restarted onto it)."""
        started: list[TaskDecision] = []
        try:
            if self._file is None or not self._read(started):
                stat = os.stat(self.path)
                if self._file is None or self._inode != stat.st_ino or stat.st_size < self._offset:
                    self.close()
                    self._file = open(self.path, "rb", buffering=0)  # closed when let go, as a file object is
                    stat = os.fstat(self._file.fileno())  # the file opened, whatever the path names by now
                    if self._inode != stat.st_ino or stat.st_size < self._offset:
                        self._inode, self._offset, self._partial = stat.st_ino, 0, b""  # a new or truncated file
                    self._read(started)
        except OSError:
            self.close()
        return started

    def _read(self, started: list[TaskDecision]) -> bool:
        """Parse what the open file holds past the offset, a piece at a time up to a short read (its end when
        read; the rest at the next poll); whether there was anything."""
        data = os.pread(self._file.fileno(), self.READ_BYTES, self._offset)
        if not data:
            return False
        while data:
            self._offset += len(data)
            self._parse(data, started)
            if len(data) < self.READ_BYTES:
                break
            data = os.pread(self._file.fileno(), self.READ_BYTES, self._offset)
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def end(self) -> tuple[int, int]:
        """Where the log ends now, as (inode, size); a task whose line ends past it started after now. Reads
        no line (a request going upstream takes this, and parsing waits until its answer is back)."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return (0, 0)
        return (stat.st_ino, stat.st_size)

    def _parse(self, data: bytes, started: list[TaskDecision]) -> None:
        begins = self._offset - len(data) - len(self._partial)  # where the pending bytes start in the file
        whole, _, self._partial = (self._partial + data).rpartition(b"\n")
        line_ends = None
        lines = whole.decode("utf-8", "replace").split("\n") if whole else []
        parser = self.parser
        number = 0
        while number < len(lines):
            # A block of the cache's listing is read at once; one that holds another line, line by line to its
            # end; outside a listing, line by line until one starts.
            left = parser.listing_left
            if left > 1 and (read := parser.feed_listing(lines[number:number + left])):
                number += read
                continue
            stop = number + left if left > 1 else len(lines)
            for number in range(number, min(stop, len(lines))):
                decision = parser.feed(lines[number])
                if decision is not None:
                    if line_ends is None:  # in bytes, counted only for a piece where a task starts (a few of many)
                        line_ends = list(accumulate(len(raw) + 1 for raw in whole.split(b"\n")))
                    decision.logged_at = (self._inode or 0, begins + line_ends[number])
                    started.append(decision)
                if left <= 1 and parser.listing_left:
                    break
            number += 1


def started_after(decision: TaskDecision, end: tuple[int, int]) -> bool:
    """Whether the log showed ``decision``'s task starting only after it ended at ``end``
    (:meth:`LogFollower.end`; a task of another file than that one is of a newer file)."""
    return decision.logged_at[0] != end[0] or decision.logged_at[1] > end[1]
