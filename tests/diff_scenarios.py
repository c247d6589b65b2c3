"""Recorded runs for the fork / attribution tests, built with the real Recorder.

A test describes each request as a turn of an episode in a run — prompt,
chosen tokens with their margins, and the cache path that served the
prompt — and ``ScenarioBook`` records it exactly as an engine patch would:
``Recorder.start_request`` inside ``kvtrace.correlate``, fields filled,
``Recorder.finish``, flushed to a spool and ingested into ClickHouse.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import kvtrace
from kvtrace import semconv as sc
from kvtrace.config import Settings
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin
from kvtrace.recording.exporters.spool import SpoolExporter

SCENARIO_ENV = {"KVTRACE_CAPTURE": "ids", "KVTRACE_HASH_KEY": "kvtrace-tests-key", "KVTRACE_BLOCK_SIZE": "4"}


@dataclass
class CachePath:
    """How the prompt of one request was served."""

    layer: str = sc.LAYER_NONE
    reused: int = 0
    state_key: Optional[str] = None
    origin: Optional[StateOrigin] = None
    event: Optional[str] = None
    """Event that served the prefix (restore / reuse / lookup hit); None: none recorded."""
    block_hashes: list[str] = field(default_factory=list)


RECOMPUTE = CachePath()


def cut_rows(record: RequestRecord, position: int, reason: str) -> None:
    """The record's per-token arrays left out from ``position``, its token ids kept, as an engine patch cuts them."""
    record.rows_cut_at, record.rows_cut_reason = position, reason
    for name in ("top1_ids", "runner_up_ids", "margins", "logprobs"):
        setattr(record, name, getattr(record, name)[:position])


class ScenarioBook:
    """Records requests of several runs into one spool directory."""

    def __init__(self, spool_dir: Path, capture: str = "ids"):
        self.spool_dir = Path(spool_dir)
        previous = {k: os.environ.get(k) for k in SCENARIO_ENV}
        os.environ.update(SCENARIO_ENV)
        os.environ["KVTRACE_CAPTURE"] = capture
        os.environ["KVTRACE_SPOOL_DIR"] = str(self.spool_dir)
        try:
            self.recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(self.spool_dir))
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            os.environ.pop("KVTRACE_SPOOL_DIR", None)
        self.records: dict[tuple[str, str, int], RequestRecord] = {}

    def turn(self, run: str, episode: str, turn: int, prompt: Sequence[int], tokens: Sequence[int],
             margins: Optional[Sequence[float]] = None, runner_up: Optional[Sequence[int]] = None,
             cache: CachePath = RECOMPUTE, arm: str = "reuse", weight_format: str = "F16",
             engine: str = "llama.cpp", at: Optional[float] = None, parent: Optional[RequestRecord] = None,
             config: Optional[dict] = None, events: Sequence[CacheEvent] = (),
             batch: Optional[tuple[Sequence[int], Sequence[int], Sequence[int]]] = None,
             rows_cut: Optional[tuple[int, str]] = None, finish_reason: str = "length") -> RequestRecord:
        """Record one request: ``tokens`` chosen with ``margins`` (default 1.0 each; ``[]``: token ids only,
        as from an engine path that ships no per-token statistics), at time ``at`` (epoch seconds; default now),
        as a child of ``parent``'s span (a server's span of a request a client recorded too), with ``config``
        added to the request's attributes, ``events`` after the cache path's, ``batch`` (step rows, step
        tokens, prefill steps) as a recorded batch composition and ``rows_cut`` (position, reason): the
        per-token arrays left out from there, the token ids kept, as an engine patch cuts them; the output
        ended for ``finish_reason``."""
        margins = [float(m) for m in margins] if margins is not None else [1.0] * len(tokens)
        runner_up = list(runner_up) if runner_up is not None else [t + 1 for t in tokens]
        caller = contextlib.nullcontext()
        if parent is not None:
            caller = trace.use_span(NonRecordingSpan(SpanContext(
                int(parent.trace_id, 16), int(parent.span_id, 16), is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        with caller, kvtrace.correlate(run_id=run, episode_id=episode, turn=turn):
            record = self.recorder.start_request(engine, model="scenario-model")
        if at is not None:
            record.start_time_unix_nano = record.end_time_unix_nano = int(at * 1e9)
        record.config = {sc.ARM: arm, sc.MODEL_WEIGHT_FORMAT: weight_format, sc.MODEL_FINGERPRINT: "fp-scenario",
                         **(config or {})}
        record.prompt_token_ids = list(prompt)
        record.prompt_tokens = len(prompt)
        record.cache_layer = cache.layer
        record.reused_tokens = cache.reused
        record.recomputed_tokens = len(prompt) - cache.reused
        record.state_key = cache.state_key
        record.state_origin = cache.origin
        record.hit_block_hashes = cache.block_hashes or None
        if cache.event:
            record.events.append(CacheEvent(
                name=cache.event, layer=cache.layer, outcome="hit", key_hash=cache.state_key,
                tokens=cache.reused, block_hashes=cache.block_hashes or None, source=cache.origin))
        record.events.extend(events)
        for chosen, margin, second in zip(tokens, margins, runner_up):
            record.add_token(chosen, chosen, second, margin, -0.1)
        if not margins:
            record.output_token_ids = list(tokens)
        if rows_cut is not None:
            cut_rows(record, *rows_cut)
        if batch is not None:
            record.batch_composition = sc.BATCH_RECORDED
            record.step_rows, record.step_tokens, record.prefill_steps = (list(b) for b in batch)
        record.finish_reason = finish_reason
        self.recorder.finish(record)
        self.records[(run, episode, turn)] = record
        return record

    def ingest(self, client) -> None:
        from kvtrace.collectors.ingest import ingest_paths

        self.recorder.pipeline.force_flush()
        ingest_paths(client, [self.spool_dir], quarantine_dir=self.spool_dir / "quarantine")


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
FIRST = [10, 11, 12]
NEXT_PROMPT = PROMPT + FIRST + [20]  # 12 tokens: turn 0's conversation plus a new observation


def record_fork_scenarios(book: ScenarioBook, run_a: str, run_b: str) -> None:
    """Two runs of the same episodes that fork in every way kvtrace distinguishes (and some that do not)."""

    def both(episode, turn, prompt, tokens, margins=None):
        for run in (run_a, run_b):
            book.turn(run, episode, turn, prompt, tokens, margins)

    # hit: A reuses the live context at turn 1, B recomputes; they part at token 2 (a near tie).
    both("hit", 0, PROMPT, FIRST)
    reuse = CachePath(sc.LAYER_KV_REUSE, 11, event=sc.EVENT_CACHE_REUSE, block_hashes=["bh-1", "bh-2"])
    book.turn(run_a, "hit", 1, NEXT_PROMPT, [30, 31, 32, 33], [2.0, 1.0, 0.02, 1.0], cache=reuse)
    book.turn(run_b, "hit", 1, NEXT_PROMPT, [30, 31, 40, 41], [2.0, 1.0, 0.03, 1.0])
    # len: both reuse, different lengths; they part at token 0 (not a near tie).
    both("len", 0, PROMPT, FIRST)
    book.turn(run_a, "len", 1, NEXT_PROMPT, [50, 51], [0.2, 1.0], cache=CachePath(sc.LAYER_KV_REUSE, 11))
    book.turn(run_b, "len", 1, NEXT_PROMPT, [52, 51], [0.25, 1.0], cache=CachePath(sc.LAYER_KV_REUSE, 8))
    # src: both restore 11 tokens from the prompt cache, but B restores state another episode stored.
    both("src", 0, PROMPT, FIRST)
    own = book.records[(run_a, "src", 0)].origin()
    foreign = book.records[(run_b, "hit", 0)].origin()
    book.turn(run_a, "src", 1, NEXT_PROMPT, [60, 61, 62], [1.0, 0.04, 1.0],
              cache=CachePath(sc.LAYER_PROMPT_CACHE, 11, "key-a", own, sc.EVENT_CACHE_RESTORE))
    book.turn(run_b, "src", 1, NEXT_PROMPT, [60, 63, 62], [1.0, 0.01, 1.0],
              cache=CachePath(sc.LAYER_PROMPT_CACHE, 11, "key-b", foreign, sc.EVENT_CACHE_RESTORE))
    # same: identical (recompute) paths, different tokens at position 4.
    book.turn(run_a, "same", 0, PROMPT, [1, 2, 3, 4, 5, 6])
    book.turn(run_b, "same", 0, PROMPT, [1, 2, 3, 4, 7, 6])
    # upstream: turn 1's prompts already differ (the harness sent something else).
    both("upstream", 0, PROMPT, FIRST)
    book.turn(run_a, "upstream", 1, PROMPT + [70], [71, 72])
    book.turn(run_b, "upstream", 1, PROMPT + [77], [71, 72])
    # calm: three identical turns.
    for turn in range(3):
        both("calm", turn, PROMPT + [turn], FIRST)
    # prefix: B generated one token more.
    book.turn(run_a, "prefix", 0, PROMPT, [1, 2, 3])
    book.turn(run_b, "prefix", 0, PROMPT, [1, 2, 3, 4])
    # lonely: only run A has it, so it is not compared.
    book.turn(run_a, "lonely", 0, PROMPT, FIRST)


def python_fork(book: ScenarioBook, run_a: str, run_b: str, episode: str) -> Optional[tuple[int, int, str]]:
    """(turn, position, kind) of the first difference, compared in plain Python, or None."""
    turns = sorted(t for (r, e, t) in book.records if r == run_a and e == episode
                   and (run_b, episode, t) in book.records)
    for t in turns:
        a, b = book.records[(run_a, episode, t)], book.records[(run_b, episode, t)]
        if a.prompt_token_ids != b.prompt_token_ids:
            kind = "prompt"
        elif a.output_token_ids != b.output_token_ids:
            kind = "output"
        else:
            continue
        ta, tb = a.output_token_ids, b.output_token_ids
        position = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        if ta == tb or kind == "prompt":  # outputs of different prompts are not compared token by token
            position = -1
        return t, position, kind
    return None


def comparable(values) -> tuple:
    """NaN (no margin at a prompt fork) compares equal to itself here."""
    return tuple(None if isinstance(v, float) and math.isnan(v) else v for v in values)


def fork_summary(diff):
    """What two captures of the same runs must agree on: each fork's place, label, margins, cache paths, culprit."""
    return [comparable((f.episode, f.turn, f.kind, f.position, f.attribution, f.near_tie, f.a.margin, f.b.margin,
                        f.a.cache.reused_tokens, f.b.cache.reused_tokens,
                        f.culprit and (f.culprit.event, f.culprit.layer, f.culprit.reused_tokens, f.culprit.key_hash)))
            for f in diff.forks]
