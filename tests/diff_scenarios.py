"""Recorded runs for the fork / attribution tests, built with the real Recorder.

A test describes each request as a turn of an episode in a run — prompt,
chosen tokens with their margins, and the cache path that served the
prompt — and ``ScenarioBook`` records it exactly as an engine patch would:
``Recorder.start_request`` inside ``kvtrace.correlate``, fields filled,
``Recorder.finish``, flushed to a spool and ingested into ClickHouse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import kvtrace
from kvtrace import semconv as sc
from kvtrace.config import Settings
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin
from kvtrace.recording.exporters.spool import SpoolExporter

SCENARIO_ENV = {"KVTRACE_CAPTURE": "ids", "KVTRACE_HASH_KEY": "kvtrace-tests", "KVTRACE_BLOCK_SIZE": "4"}


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
             engine: str = "llama.cpp") -> RequestRecord:
        """Record one request: ``tokens`` chosen with ``margins`` (default 1.0 each; ``[]``: token ids only,
        as from an engine path that ships no per-token statistics)."""
        margins = [float(m) for m in margins] if margins is not None else [1.0] * len(tokens)
        runner_up = list(runner_up) if runner_up is not None else [t + 1 for t in tokens]
        with kvtrace.correlate(run_id=run, episode_id=episode, turn=turn):
            record = self.recorder.start_request(engine, model="scenario-model")
        record.config = {sc.ARM: arm, sc.MODEL_WEIGHT_FORMAT: weight_format, sc.MODEL_FINGERPRINT: "fp-scenario"}
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
        for chosen, margin, second in zip(tokens, margins, runner_up):
            record.add_token(chosen, chosen, second, margin, -0.1)
        if not margins:
            record.output_token_ids = list(tokens)
        record.finish_reason = "length"
        self.recorder.finish(record)
        self.records[(run, episode, turn)] = record
        return record

    def ingest(self, client) -> None:
        from kvtrace.collectors.ingest import ingest_paths

        self.recorder.pipeline.force_flush()
        ingest_paths(client, [self.spool_dir], quarantine_dir=self.spool_dir / "quarantine")


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
        if ta == tb:
            position = -1
        return t, position, kind
    return None
